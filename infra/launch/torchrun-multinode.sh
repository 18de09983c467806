#!/usr/bin/env bash
# mt under torchrun on several nodes: run this on every node with the same MASTER_ADDR.
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node001 infra/launch/torchrun-multinode.sh --tp 8 --pp 4
# A failed or lost worker restarts every worker (MAX_RESTARTS times, default 3); they resume
# from mt's --save folder by themselves (pass --save-interval N so there is one to resume).
set -euo pipefail
: "${NNODES:?number of nodes}" "${NODE_RANK:?the index of this node}" "${MASTER_ADDR:?rank-0 host}"
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "${GPUS_PER_NODE:-8}" \
  --max-restarts "${MAX_RESTARTS:-3}" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
  -m mt_pretrain pretrain "$@"
