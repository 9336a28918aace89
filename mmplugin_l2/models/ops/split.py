"""The one rule that cuts an op's work into pieces.

A piece holds about `piece` elements (the memory policy's `max_elems`, given by `dispatch.choose`), counted
in the op's unit (`ops/memory.py`): `unit` elements per index along the axis that is cut (per token, per
row of queries, per output row of a convolution chain). `piece_length` is how many indices that makes,
`split` the pieces themselves, with an optional halo of neighbouring indices that a piece reads but does not
own (the rows a 3x3 convolution needs above and below its piece).
"""
from typing import NamedTuple


class Piece(NamedTuple):
    """Indices [start, stop) that the piece owns, and [lo, hi): those widened by the halo, clipped to the
    axis."""
    start: int
    stop: int
    lo: int
    hi: int

    @property
    def own(self):
        """slice(start, stop): the indices the piece owns."""
        return slice(self.start, self.stop)


def piece_length(piece, unit=1, multiple=1):
    """Indices per piece: about `piece` elements at `unit` elements per index, a multiple of `multiple`
    indices, at least `multiple`."""
    return max(1, piece // (unit * multiple)) * multiple


def split(n, piece, unit=1, halo=0, multiple=1):
    """The pieces of an axis of `n` indices.

    Args:
        n (int): length of the axis.
        piece (int | None): elements per piece; None: one piece, the whole axis.
        unit (int): elements per index. Default: 1.
        halo (int): neighbouring indices each side that a piece reads as well. Default: 0.
        multiple (int): a piece's length is a multiple of this (the last may be shorter). Default: 1.

    Returns:
        list[Piece]: covering [0, n) in order, without overlap of their [start, stop).
    """
    step = n if piece is None else piece_length(piece, unit, multiple)
    return [Piece(s, min(n, s + step), max(0, s - halo), min(n, s + step + halo))
            for s in range(0, n, max(step, 1))]
