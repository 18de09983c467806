#!/usr/bin/env bash
# mt under torchrun on several nodes: run this on every node with the same MASTER_ADDR.
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node001 infra/launch/torchrun-multinode.sh --tp 8 --pp 4
# A failed or lost worker restarts every worker (MAX_RESTARTS times, default 3); they resume
# from mt's --save folder by themselves (pass --save-interval N so there is one to resume).
# Elastic: NNODES=2:4 lets torchrun go on with 2 to 4 nodes, restarting the workers at the new
# size when a node leaves or joins; such a restart is not counted as one, so also pass --load
# with the run's own checkpoint folder (--load OUT_DIR/checkpoints: step 0 while it is empty),
# and each start continues from the newest checkpoint at the data-parallel degree it is given.
# Every round of the rendezvous gets its own workers' store: torch's agents otherwise keep the
# store address of the first round they saw, which a node joining a running job never finds.
set -euo pipefail
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
: "${NNODES:?number of nodes}" "${NODE_RANK:?the index of this node}" "${MASTER_ADDR:?rank-0 host}"
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "${GPUS_PER_NODE:-8}" \
  --max-restarts "${MAX_RESTARTS:-3}" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
  -m mt_pretrain pretrain "$@"
