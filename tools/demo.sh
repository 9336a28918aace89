#!/usr/bin/env bash
# The demo: train Mask R-CNN with an H-ViT3-T backbone on generated COCO-format data, then test it and
# print COCO box and mask AP. configs/demo/mask_rcnn_hvit3_t_demo.py is configs/mmdet/mask_rcnn_hvit3_t_1x.py
# with only the data paths, image scale and schedule overridden. ~15 min on 2 CPU cores.
#
#   bash tools/demo.sh [WORK_DIR] [extra tools/train.py args...]
set -euo pipefail
cd "$(dirname "$0")/.."
WORK_DIR=${1:-work_dirs/demo_mask_rcnn_hvit3_t}
shift || true
CONFIG=configs/demo/mask_rcnn_hvit3_t_demo.py

if [ ! -f data/demo/coco/annotations/instances_val2017.json ]; then
  python tools/make_demo_data.py --out data/demo --task coco
fi
python tools/train.py "$CONFIG" --work-dir "$WORK_DIR" "$@"
CKPT=$(cat "$WORK_DIR/last_checkpoint")
python tools/test.py "$CONFIG" "$CKPT" --work-dir "$WORK_DIR" --out "$WORK_DIR/test_metrics.json" \
  --show-dir vis
echo "Demo done: checkpoint $CKPT, metrics $WORK_DIR/test_metrics.json, drawings under $WORK_DIR/*/vis"
