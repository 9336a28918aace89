#!/usr/bin/env bash
# Distributed training with torchrun: bash tools/dist_train.sh CONFIG NUM_PROCS [train.py args...]
# On CPU the processes talk over gloo (mmengine picks it when CUDA is absent).
CONFIG=$1
NPROC=$2
shift 2
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
exec python -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" \
  --master_addr="$MASTER_ADDR" --master_port="$PORT" --nproc_per_node="$NPROC" \
  "$(dirname "$0")/train.py" "$CONFIG" --launcher pytorch "$@"
