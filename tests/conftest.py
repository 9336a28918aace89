import os.path as osp
import sys

import pytest
import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import mmplugin_l2  # noqa: E402,F401

torch.set_num_threads(2)

#: a narrow H-ViT3 for tests where the architecture, not the width, is the point
TINY_HVIT3 = dict(embed_dims=[16, 32, 64, 64], depths=[1, 1, 2, 1], num_heads=[1, 1, 2, 2])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
