"""mmplugin_l2: H-ViT3, L2ViT and ResT backbones for mmdet / mmseg / mmpretrain.

`pip install -e .` (or `pip install .`) also installs configs/, tools/ and model-index.yml under
mmplugin_l2/.mim, OpenMMLab's convention (as mmdet's setup.py does): `mim search mmplugin_l2`,
`mim train mmplugin_l2 CONFIG` and `_base_ = 'mmplugin_l2::mmdet/...'` read them from there. An editable
install links them (edits in configs/ are seen at once), a wheel/sdist build copies them.
"""
import os
import os.path as osp
import shutil
import sys

from setuptools import find_packages, setup

HERE = osp.dirname(osp.abspath(__file__))
MIM_FILES = ['configs', 'tools', 'model-index.yml']


def read_version():
    scope = {}
    with open(osp.join(HERE, 'mmplugin_l2', 'version.py'), encoding='utf-8') as f:
        exec(compile(f.read(), 'version.py', 'exec'), scope)
    return scope['__version__']


def add_mim_extension():
    """Link (editable install) or copy (wheel, sdist, plain install) the mim files into mmplugin_l2/.mim."""
    if any(cmd in sys.argv for cmd in ('develop', 'editable_wheel')):
        mode = 'symlink'
    elif any(cmd in sys.argv for cmd in ('sdist', 'bdist_wheel', 'build', 'install', 'build_py')):
        mode = 'copy'
    else:
        return  # egg_info, dist_info, --version, ...: nothing to install
    mim_path = osp.join(HERE, 'mmplugin_l2', '.mim')
    os.makedirs(mim_path, exist_ok=True)
    for name in MIM_FILES:
        src = osp.join(HERE, name)
        dst = osp.join(mim_path, name)
        if not osp.exists(src):
            raise FileNotFoundError(f'{src} is missing: the mim extension needs {MIM_FILES}')
        if osp.islink(dst) or osp.isfile(dst):
            os.remove(dst)
        elif osp.isdir(dst):
            shutil.rmtree(dst)
        if mode == 'symlink':
            os.symlink(osp.relpath(src, mim_path), dst)
        elif osp.isdir(src):
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
        else:
            shutil.copyfile(src, dst)


with open(osp.join(HERE, 'README.md'), encoding='utf-8') as f:
    long_description = f.read()

# The OpenMMLab libraries are extras: mmcv 2.1.0 (the newest that mmdet 3.3 / mmseg 1.2 accept) has no wheel
# for current torch on PyPI, and `pip install mmcv` then builds it from source with settings pip alone does
# not know (docs/get_started.md). tools/install.sh does that build; `pip install -e .[all]` works as is
# where a prebuilt mmcv 2.1.0 wheel is reachable (PIP_FIND_LINKS) or mmcv is already installed.
MMCV = 'mmcv>=2.0.0,<2.2.0'
extras = {
    'mmdet': [MMCV, 'mmdet>=3.0.0,<3.4.0', 'pycocotools'],
    'mmseg': [MMCV, 'mmsegmentation>=1.0.0,<1.3.0', 'ftfy', 'regex'],
    'mmpretrain': [MMCV, 'mmpretrain>=1.0.0,<1.3.0'],
    'onnx': ['onnx', 'onnxruntime', 'onnxscript'],
    'tests': ['pytest', 'pytest-xdist', 'pyyaml'],
    'mim': ['openmim'],
    'vis': ['grad-cam>=1.3.6,<1.5', 'matplotlib'],   # docs/visualization.md (vis_cam.py needs < 1.5)
}
extras['all'] = sorted({req for reqs in extras.values() for req in reqs})

add_mim_extension()
setup(
    name='mmplugin_l2',
    version=read_version(),
    description='Linear-complexity vision backbones (H-ViT3, L2ViT, ResT) as an OpenMMLab plugin',
    long_description=long_description,
    long_description_content_type='text/markdown',
    license='Apache License 2.0',
    keywords='computer vision, backbone, test-time training, linear attention, openmmlab',
    packages=find_packages(include=['mmplugin_l2', 'mmplugin_l2.*']),
    include_package_data=True,
    package_data={'mmplugin_l2': ['.mim/model-index.yml', '.mim/configs/**/*', '.mim/tools/**/*']},
    python_requires='>=3.9',
    install_requires=['torch>=2.0', 'mmengine>=0.10.0', 'numpy'],
    extras_require=extras,
    classifiers=[
        'License :: OSI Approved :: Apache Software License',
        'Programming Language :: Python :: 3',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
    zip_safe=False,
)
