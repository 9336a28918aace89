#!/usr/bin/env bash
# Installs the stack mmplugin_l2 is tested on, then the plugin itself (a development install
# of this checkout), unless it is installed already.
#
#   bash tools/install.sh [--force]        (PYTHON=/path/to/python to pick the interpreter)
#
#   torch 2.14.1 / torchvision 0.29.1 (a torch you already have is kept), mmengine 0.10.7,
#   mmcv 2.1.0 with compiled ops, mmdet 3.3.0, mmsegmentation 1.2.2, mmpretrain 1.2.0, pycocotools,
#   onnx / onnxruntime / onnxscript (ONNX export), openmim, grad-cam, timm, pytest, pytest-xdist, pyyaml; then this checkout as a development
#   install that `mim search / train / test mmplugin_l2` and `_base_ = 'mmplugin_l2::...'` find.
#
# "Installed" (checked in a few seconds, then nothing is done; --force reinstalls): mmdet, mmseg, mmpretrain,
# mmcv 2.1.0 with mmcv.ops, onnxruntime, pycocotools, mim, pytest (with xdist), grad-cam and timm import, `import mmplugin_l2` finds
# this checkout (not another copy) and so does mim (the distribution's location). tools/demo.sh and
# tools/run_tests.sh call this script first.
#
# mmcv 2.1.0 has no wheel for current torch on PyPI, so pip builds it from source (docs/get_started.md#install says
# how long).
# The build needs: no build isolation (it imports torch), MMCV_WITH_OPS=1, setuptools that still ships
# pkg_resources (>=77.0.3,<82, also what torch accepts) and C++20 (torch >= 2.14 headers refuse C++17,
# while mmcv's setup.py hard-codes -std=c++17: a g++ wrapper appends -std=c++20, the last -std wins).
# Set PIP_FIND_LINKS to a folder holding a prebuilt mmcv wheel to skip the build.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}

stack_installed() {
  # run outside the checkout, so that `import mmplugin_l2` cannot succeed just because it is the cwd
  (cd / && "$PY" - "$here" <<'PY' 2>/dev/null
import os.path as osp, sys
import mmcv, mmcv.ops, mmdet, mmseg, mmpretrain, onnxruntime, pycocotools, mim, pytest, xdist, pytorch_grad_cam, timm  # noqa: F401
import mmplugin_l2
assert mmcv.__version__ == '2.1.0', mmcv.__version__
assert osp.samefile(osp.dirname(mmplugin_l2.__file__), osp.join(sys.argv[1], 'mmplugin_l2'))
assert osp.isfile(osp.join(sys.argv[1], 'mmplugin_l2', '.mim', 'model-index.yml'))
# where mim and mmengine (`mmplugin_l2::`) look for the configs: the distribution's location
import warnings
with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    import pkg_resources
assert osp.samefile(pkg_resources.get_distribution('mmplugin_l2').location, sys.argv[1])
PY
  )
}

if [ "${1:-}" != "--force" ] && stack_installed; then
  echo "[install] the stack is installed ($("$PY" -c 'import sys; print(sys.executable)')): nothing to do"
  exit 0
fi

# every pip call below keeps setuptools in that range: a later install that resolves torch's dependencies
# (e.g. grad-cam) would otherwise upgrade it past 81, which drops pkg_resources (openmim imports it)
cons=$(mktemp)
echo 'setuptools>=77.0.3,<82' > "$cons"
export PIP_CONSTRAINT="${PIP_CONSTRAINT:+$PIP_CONSTRAINT }$cons"

echo "[install 1/3] torch, mmengine and the Python dependencies..."
if ! "$PY" -c "import torch, torchvision" 2>/dev/null; then
  "$PY" -m pip install torch==2.14.1 torchvision==0.29.1
fi
"$PY" -m pip install 'setuptools>=77.0.3,<82' wheel ninja 'numpy>=2' 'mmengine==0.10.7' pycocotools ftfy regex \
  scipy shapely terminaltables matplotlib pytest pytest-xdist pyyaml

if ! "$PY" -c "import mmcv, mmcv.ops; assert mmcv.__version__ == '2.1.0'" 2>/dev/null; then
  echo "[install 2/3] mmcv 2.1.0 with ops (a prebuilt wheel from PIP_FIND_LINKS, else a source build of many minutes)..."
  wrap=$(mktemp -d)
  printf '#!/bin/sh\nexec g++ "$@" -std=c++20\n' > "$wrap/g++20"
  chmod +x "$wrap/g++20"
  CXX="$wrap/g++20" MMCV_WITH_OPS=1 MAX_JOBS=${MAX_JOBS:-2} \
    "$PY" -m pip install --no-build-isolation 'mmcv==2.1.0'
else
  echo "[install 2/3] mmcv 2.1.0 with ops: installed"
fi
echo "[install 3/3] mmdet, mmseg, mmpretrain, onnx, openmim and mmplugin_l2 (development install of this checkout)..."
"$PY" -m pip install 'mmdet==3.3.0' 'mmsegmentation==1.2.2' 'mmpretrain==1.2.0'
# ONNX export and its checks (tools/deployment/, docs/deployment.md)
"$PY" -m pip install onnx onnxruntime onnxscript openmim
# Grad-CAM (docs/visualization.md): mmpretrain's tools/visualization/vis_cam.py needs grad-cam < 1.5
"$PY" -m pip install 'grad-cam>=1.3.6,<1.5'
# timm: the authors' backbone files import it (--authors-code), and the device check takes Swin-T from it where
# mmdet is missing (the GPU machine's image has timm; tests/test_device_check.py rehearses that machine)
"$PY" -m pip install 'timm==1.0.31'
# mmplugin_l2 itself, as a development install that mim and mmengine can find: the distribution's metadata
# (mmplugin_l2.egg-info, from `setup.py egg_info`) lives in the checkout, site-packages holds an egg-link to it
# and the checkout on sys.path (easy-install.pth), and mmplugin_l2/.mim links configs/, tools/ and
# model-index.yml. mim and mmengine look for `<location of the distribution>/mmplugin_l2/.mim`, which is then
# this checkout; with pip's editable installs (PEP 660) the location is site-packages, where there is no .mim.
# Edits in the checkout are seen at once; `pip uninstall mmplugin_l2` removes it.
"$PY" -m pip uninstall -y mmplugin_l2 >/dev/null 2>&1 || true      # a former pip install (editable or not)
(cd "$here" && "$PY" setup.py -q egg_info >/dev/null)
mkdir -p "$here/mmplugin_l2/.mim"
for f in configs tools model-index.yml; do
  rm -rf "$here/mmplugin_l2/.mim/$f"
  ln -s "../../$f" "$here/mmplugin_l2/.mim/$f"
done
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n.\n' "$here" > "$site/mmplugin_l2.egg-link"
# easy-install.pth: this checkout, and no other mmplugin_l2 checkout (pip does not uninstall a development install
# outside the environment's prefix, so an earlier clone's line would stay first on sys.path)
"$PY" - "$site/easy-install.pth" "$here" <<'PY'
import os.path as osp, sys
pth, here = sys.argv[1:]
lines = open(pth).read().splitlines() if osp.isfile(pth) else []
keep = [ln for ln in lines if not osp.isfile(osp.join(ln.strip(), 'mmplugin_l2', '__init__.py'))]
with open(pth, 'w') as f:
    f.write('\n'.join(keep + [here]) + '\n')
PY
if ! stack_installed; then
  echo "[install] the stack does not import after installing; see the pip output above" >&2
  exit 1
fi
"$PY" -c "import mmcv, torch; print('mmplugin_l2 stack OK: torch', torch.__version__, 'mmcv', mmcv.__version__)"
