"""mmplugin_l2: H-ViT3, L2ViT and ResT backbones for mmdet / mmseg / mmpretrain."""
from setuptools import find_packages, setup

setup(
    name='mmplugin_l2',
    version='0.1.0',
    description='Linear-complexity vision backbones (H-ViT3, L2ViT, ResT) as an OpenMMLab plugin',
    packages=find_packages(include=['mmplugin_l2', 'mmplugin_l2.*']),
    python_requires='>=3.9',
    # The OpenMMLab stack (mmcv with compiled ops in particular) is installed by tools/install.sh,
    # which knows how to build mmcv 2.1.0 for current torch; pip alone cannot.
    install_requires=['torch>=2.0', 'mmengine>=0.10.0', 'numpy'],
    extras_require={'tests': ['pytest']},
)
