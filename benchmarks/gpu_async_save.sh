#!/usr/bin/env bash
# One prepared run for a lent GPU (issue 44: what an asynchronous save costs training there).
#
# From the repository root, no downloads, under 8 minutes:
#   (a) benchmarks/async_save.py on cuda: GPT-2 small with fp32 weights and AdamW moments on the
#       GPU (1.5 GB per save), bf16 autocast, 16 x 1024 tokens a step, a save every 50 steps,
#       mt's foreground and background saves beside DCP save / async_save, 2 repeats; first
#       whether the background file is the foreground file byte for byte;
#   (b) mt pretrain --device cuda, 8 steps of the tiny model saving every 2 steps, in the
#       foreground and with --async-save: whether the rank files are the same bytes.
# The GPU machine lacks the crc32c package: carry its wheel in .whl/ (see the device tool's
# README: pip download --only-binary=:all: --python-version 3.12 ... crc32c==2.9.post0); it
# is installed from there into /tmp/site. Logs go to $OUT (a temporary folder if unset).
# GPU_SH_DRY=1 checks the wiring on a CPU machine (tiny steps, --device cpu).
set -u -o pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$(mktemp -d -t mt-gpu-XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    EXTRA=/tmp/site:
else
    EXTRA=
fi
PYTHONPATH=$EXTRA$(ls -d packages/*/src apps/*/src | tr '\n' ':')${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH PYTHONUNBUFFERED=1
if [ "${GPU_SH_DRY:-0}" = 1 ]; then
    DEVICE=cpu
    BENCH=(--batch 1 --seq 32 --steps 5 --every 2 --repeats 1)
else
    DEVICE=cuda
    BENCH=(--batch 16 --seq 1024 --steps 150 --every 50 --repeats 2)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
echo "=== $(date -u '+%Y-%m-%d %H:%M:%S UTC'), OUT=$OUT, $(nproc) cores"
"$PY" -c "import torch; print('torch', torch.__version__)"
df -h /tmp /dev/shm
mkdir -p /tmp/mt-async-bench
timeout -k 5 380 "$PY" benchmarks/async_save.py --device "$DEVICE" "${BENCH[@]}" \
    --dir /tmp/mt-async-bench 2>&1 | grep -v " - root - INFO - " | tee "$OUT/async_save.log"
echo "=== async_save.py: exit ${PIPESTATUS[0]}"
for mode in no-async-save async-save; do
    timeout -k 5 90 "$PY" -m mt_pretrain pretrain --device "$DEVICE" --model tiny \
        --train-steps 8 --save-interval 2 --keep-last 10 --eval-interval 0 \
        --sample-tokens 0 --no-progress "--$mode" --out-dir "/tmp/mt-run-$mode" --overwrite \
        --cache-dir /tmp/mt-cache 2>&1 | tail -n 3 | tee -a "$OUT/pretrain.log"
done
"$PY" - <<'PY' 2>&1 | tee -a "$OUT/pretrain.log"
from pathlib import Path
a, b = Path("/tmp/mt-run-no-async-save/checkpoints"), Path("/tmp/mt-run-async-save/checkpoints")
for step in sorted(p.name for p in a.glob("step-*")):
    files = sorted((a / step).glob("rank-*.pt"))
    print(step, "same bytes:", [f.read_bytes() == (b / step / f.name).read_bytes() for f in files])
PY
