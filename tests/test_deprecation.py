"""Renamed public names keep working for one release with a DeprecationWarning naming the new one:
the backbones' `recompute` (now `fast_train`), `naive_emsa_attention` (now `emsa_attention_reference`) and
`ChunkedEMSAAttention` (now `EMSAPiecesFunction`)."""
import pytest

from conftest import TINY_HVIT3, TINY_L2VIT, TINY_REST, TINY_VIT3
from mmplugin_l2 import HViT3, L2ViT, ResT, ViT3

_BUILD = {
    'HViT3': lambda **kw: HViT3(arch=TINY_HVIT3, **kw),
    'ViT3': lambda **kw: ViT3(arch=TINY_VIT3, **kw),
    'L2ViT': lambda **kw: L2ViT(arch=TINY_L2VIT, **kw),
    'ResT': lambda **kw: ResT(arch=TINY_REST, **kw),
}


def _switches(model):
    """{module name: fast_train} of every module with the switch."""
    return {n: m.fast_train for n, m in model.named_modules() if hasattr(m, 'fast_train')}


@pytest.mark.parametrize('name', sorted(_BUILD))
def test_recompute_is_fast_train_with_a_warning(name):
    with pytest.warns(DeprecationWarning, match='`recompute` is renamed `fast_train`'):
        old = _BUILD[name](recompute=False)
    assert _switches(old) == _switches(_BUILD[name](fast_train=False)) != _switches(_BUILD[name]())


@pytest.mark.parametrize('module', ['mmplugin_l2.models.layers', 'mmplugin_l2.models.layers.emsa',
                                    'mmplugin_l2.models.ops.emsa'])
def test_old_emsa_names_warn_and_are_the_new_objects(module):
    import importlib
    mod = importlib.import_module(module)
    for old, new in (('naive_emsa_attention', 'emsa_attention_reference'),
                     ('ChunkedEMSAAttention', 'EMSAPiecesFunction')):
        with pytest.warns(DeprecationWarning, match=f'`{old}` is renamed `{new}`'):
            assert getattr(mod, old) is getattr(mod, new)
    with pytest.raises(AttributeError):
        mod.no_such_name
