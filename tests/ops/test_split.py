"""`ops.split`: the one piece rule."""
import pytest

from mmplugin_l2.models.ops.split import Piece, piece_length, split


def test_pieces_cover_the_axis_in_order_without_overlap():
    for n in (1, 7, 10, 33):
        for piece, unit, multiple in ((10, 1, 1), (24, 4, 1), (24, 2, 3), (1, 5, 1), (1000, 3, 2)):
            pieces = split(n, piece, unit, multiple=multiple)
            assert [p.start for p in pieces] == sorted(p.start for p in pieces)
            assert pieces[0].start == 0 and pieces[-1].stop == n
            assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))
            length = piece_length(piece, unit, multiple)
            assert all(p.stop - p.start == length for p in pieces[:-1])
            assert 0 < pieces[-1].stop - pieces[-1].start <= length


@pytest.mark.parametrize('piece,unit,multiple,expected', [(100, 7, 1, 14), (100, 7, 3, 12), (5, 7, 1, 1),
                                                          (5, 7, 4, 4), (64, 8, 2, 8)])
def test_piece_length_counts_elements(piece, unit, multiple, expected):
    assert piece_length(piece, unit, multiple) == expected


def test_whole_axis_and_halo():
    assert split(9, None) == [Piece(0, 9, 0, 9)]
    assert split(9, 4, halo=1) == [Piece(0, 4, 0, 5), Piece(4, 8, 3, 9), Piece(8, 9, 7, 9)]
    assert split(0, 4) == []


def test_a_piece_owns_its_slice():
    x = list(range(10))
    assert [x[p.own] for p in split(10, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
