#!/usr/bin/env bash
# The demo from a fresh clone: installs the stack when it is missing (tools/install.sh; skipped in a few
# seconds when installed), generates the demo data, trains Mask R-CNN with an H-ViT3-T backbone on it, then
# tests it and prints COCO box and mask AP. configs/demo/mask_rcnn_hvit3_t_demo.py is
# configs/mmdet/mask_rcnn_hvit3_t_1x.py with only the data paths, image scale and schedule overridden.
# How long it takes and the AP it reaches: docs/get_started.md#demo.
#
#   bash tools/demo.sh [WORK_DIR] [extra tools/train.py args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WORK_DIR=${1:-work_dirs/demo_mask_rcnn_hvit3_t}
shift || true
CONFIG=configs/demo/mask_rcnn_hvit3_t_demo.py

echo "[1/4] the stack (tools/install.sh)..."
bash tools/install.sh
if [ ! -f data/demo/coco/annotations/instances_val2017.json ]; then
  echo "[2/4] generating the demo data (data/demo)..."
  "$PY" tools/make_demo_data.py --out data/demo --task coco
else
  echo "[2/4] demo data: data/demo is there"
fi
echo "[3/4] training $CONFIG (work dir $WORK_DIR)..."
"$PY" tools/train.py "$CONFIG" --work-dir "$WORK_DIR" "$@"
CKPT=$(cat "$WORK_DIR/last_checkpoint")
echo "[4/4] testing $CKPT..."
"$PY" tools/test.py "$CONFIG" "$CKPT" --work-dir "$WORK_DIR" --out "$WORK_DIR/test_metrics.json" \
  --show-dir vis
echo "Demo done: checkpoint $CKPT, metrics $WORK_DIR/test_metrics.json, drawings under $WORK_DIR/*/vis"
