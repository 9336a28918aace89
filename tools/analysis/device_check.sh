#!/usr/bin/env bash
# One-shot accelerator check of the backbones in at most --budget seconds (default 540: a 10-minute slot with
# start-up to spare), on the machine's own python and torch (docs/device_check.md). Parts in priority order:
# preflight, eval parity and training gradients against CPU float64, the AMP training step (bf16, fp16 with a
# grad scaler), host synchronisation, then speed and peak memory (fp32, TF32, bf16) against the authors' code,
# DeiT-T and Swin-T. Each model of each part runs in its own process under a time limit; the results are
# rewritten after each: OUT_DIR/device_check.json, device_check.md, speed_<precision>.json, errors/*.txt.
#
#   bash tools/analysis/device_check.sh [--carry DIR] [--out-dir DIR] [--budget S] [device_check.py args]
#
# --carry DIR: what tools/analysis/device_wheels.sh prepared here: DIR/wheels/*.whl (pure-Python, pinned) are
#   installed without network into a --target folder (SITE, default /tmp/mmplugin_l2_site) put first on
#   PYTHONPATH, so the machine's own python keeps its torch; DIR/authors/FAMILY (the authors' backbone files)
#   become --authors-code FAMILY=DIR/authors/FAMILY. Without --carry, the python must import mmengine and mmcv.
# PYTHON: the interpreter (default python3). --out-dir defaults to $OUT where set, else work_dirs/device_check.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
SITE="${SITE:-/tmp/mmplugin_l2_site}"
CARRY=""
OUT_DIR="${OUT:-work_dirs/device_check}"
BUDGET=540
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --carry) CARRY="${2:?--carry DIR}"; shift 2 ;;
    --out-dir) OUT_DIR="${2:?--out-dir DIR}"; shift 2 ;;
    --budget) BUDGET="${2:?--budget SECONDS}"; shift 2 ;;
    -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

START=$(date +%s)
cd "$ROOT"
AUTHORS=()
if [ -n "$CARRY" ]; then
  shopt -s nullglob
  WHEELS=("$CARRY"/wheels/*.whl)
  if [ ${#WHEELS[@]} -eq 0 ]; then
    echo "[device_check.sh] --carry $CARRY: no wheels in $CARRY/wheels (prepare them: bash tools/analysis/device_wheels.sh)" >&2
    exit 2
  fi
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$SITE" "${WHEELS[@]}"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  for d in "$CARRY"/authors/*/; do d="${d%/}"; AUTHORS+=("${d##*/}=$d"); done
  echo "[device_check.sh] ${#WHEELS[@]} carried wheels in $SITE${AUTHORS[*]:+; authors code: ${AUTHORS[*]}}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'EOF'
import importlib.util, sys
missing = [m for m in ('torch', 'mmengine', 'mmcv') if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f'[device_check.sh] {sys.executable} cannot import {", ".join(missing)}: pass --carry DIR '
             '(bash tools/analysis/device_wheels.sh prepares it) or install them')
EOF
# the python driver keeps each part (each model) within its share of what is left, less 10 s to write the
# last results
LEFT=$(( BUDGET - ($(date +%s) - START) - 10 ))
echo "[device_check.sh] $("$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'); ${LEFT} s for the parts"
[ ${#AUTHORS[@]} -gt 0 ] && ARGS+=(--authors-code "${AUTHORS[@]}")
# the hard limit: SIGTERM 30 s after the driver's budget (the driver records the model it was in as stopped;
# every finished model is already on disk), SIGKILL 10 s later
set +e
timeout --kill-after=10 $(( LEFT + 30 )) "$PY" tools/analysis/device_check.py --budget "$LEFT" \
  --out-dir "$OUT_DIR" "${ARGS[@]}"
RC=$?
set -e
echo "[device_check.sh] exit $RC after $(( $(date +%s) - START )) s: $OUT_DIR/device_check.json, device_check.md, speed_*.json, errors/"
exit $RC
