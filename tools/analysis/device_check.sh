#!/usr/bin/env bash
# One-shot accelerator check of the H-ViT3 / L2ViT / ResT backbones, in at most --budget seconds (default 540,
# a 10-minute slot with start-up to spare): fp32 parity against CPU float64, no host synchronisation,
# fp16 / bf16 autocast at 1248^2, inference latency and training-step time / memory against the authors'
# code and Swin-T. Writes DIR/device_check.json and DIR/device_check.md (docs/benchmark.md#device-check).
#
#   bash tools/analysis/device_check.sh [--wheels DIR] [--venv DIR] [--out-dir DIR] [device_check.py args]
#   bash tools/analysis/device_check.sh --fetch-wheels DIR     # on a machine with network: the wheels to carry
#
# Needs torch with CUDA (the machine's own). --wheels DIR: a folder of wheels (from --fetch-wheels) installed
# without network into a virtual environment (--venv, default /tmp/mmplugin_l2_venv) that sees the system's
# torch; without --wheels the current python is used and must import mmengine, mmcv (mmcv-lite is enough: no
# compiled ops) and timm. mmdet is optional (Swin-T then comes from timm). Authors' code:
#   --authors-code ViTTT=PATH L2ViT=PATH ResT=PATH   (clones of their repositories)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WHEELS=""
VENV="/tmp/mmplugin_l2_venv"
OUT="work_dirs/device_check"
BUDGET=540
ARGS=()
# the Python-only stack of the backbones and the benchmark (torch excluded: the machine's own is used)
PKGS=(mmengine==0.10.7 mmcv-lite==2.1.0 timm addict yapf termcolor rich markdown-it-py mdurl pygments
      platformdirs tomli pyyaml packaging numpy pillow opencv-python-headless matplotlib contourpy cycler
      fonttools kiwisolver pyparsing python-dateutil six huggingface_hub safetensors filelock fsspec requests
      tqdm typing_extensions idna certifi charset-normalizer urllib3 hf-xet)

while [ $# -gt 0 ]; do
  case "$1" in
    --fetch-wheels)
      DIR="${2:?--fetch-wheels DIR}"; mkdir -p "$DIR"
      echo "[device_check.sh] downloading ${#PKGS[@]} packages (no torch) into $DIR"
      python -m pip download --no-deps --only-binary=:all: -d "$DIR" "${PKGS[@]}"
      echo "[device_check.sh] also carry torchvision matching the machine's torch if it lacks one (timm imports it)"
      exit 0 ;;
    --wheels) WHEELS="${2:?--wheels DIR}"; shift 2 ;;
    --venv) VENV="${2:?--venv DIR}"; shift 2 ;;
    --out-dir) OUT="${2:?--out-dir DIR}"; shift 2 ;;
    --budget) BUDGET="${2:?--budget SECONDS}"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

START=$(date +%s)
PY=python
if [ -n "$WHEELS" ]; then
  echo "[device_check.sh] venv $VENV (system site-packages for torch), wheels from $WHEELS"
  python -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl
  PY="$VENV/bin/python"
fi
"$PY" - <<'EOF'
import importlib, sys
missing = [m for m in ('torch', 'mmengine', 'mmcv', 'timm') if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f'[device_check.sh] missing: {", ".join(missing)} (install them, or pass --wheels DIR; see --fetch-wheels)')
EOF
LEFT=$(( BUDGET - ($(date +%s) - START) ))
echo "[device_check.sh] $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'); ${LEFT} s left"
cd "$ROOT"
# the hard limit: the python driver keeps each part within its share; this stops everything at the budget
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=15 $(( LEFT + 30 )) \
  "$PY" tools/analysis/device_check.py --budget "$LEFT" --out-dir "$OUT" "${ARGS[@]}"
echo "[device_check.sh] done in $(( $(date +%s) - START )) s: $OUT/device_check.json, $OUT/device_check.md"
