#!/usr/bin/env bash
# One prepared run for a lent GPU (one H200, ~15 minutes of device time; issue 17).
#
# From the repository root, no downloads, under 6 minutes in all (every step has its own
# timeout, cut to what is left of GPU_SH_BUDGET seconds, 340 by default):
#   (a) mt plan --calibrate: measure the GPU at the 1.3B shapes, write $OUT/h200-1.3b.yaml and
#       plan micro-batch 8 / no recompute with it; then the same layout at full recompute
#       with --gpu $OUT/h200-1.3b.yaml (no re-calibration);
#   (b) benchmarks/train.py on cuda, bf16, mt / mt+compile / hf / hf+compile one after another:
#       1.3b (batch 8 x 2048) and gpt2-small (batch 16 x 1024), MFU over 989 TFLOP/s, with
#       mt_plan's prediction on the h200 data sheet and on the calibration file; JSON to $OUT;
#   (c) mt pretrain of 1.3b, bf16, micro-batch 8, 12 steps on the embedded corpus; its last
#       progress lines and metrics line (tokens/s, MFU, peak_mem_gib);
#   (d) the same with --recompute selective, if the budget leaves time.
# Logs and results go to $OUT (a temporary folder if unset). Run on the GPU machine:
#
#     bash benchmarks/gpu.sh
#
# GPU_SH_DRY=1 checks the wiring on a CPU machine in about a minute: tiny stand-ins for the
# models, --device cpu (torch.compile only in the first train.py step), the same commands
# and flags otherwise.
set -u -o pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$(mktemp -d -t mt-gpu-XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DRY=${GPU_SH_DRY:-0}
BUDGET=${GPU_SH_BUDGET:-340}
START=$SECONDS
PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\n' ':')${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
CALIB=$OUT/h200-1.3b.yaml

if [ "$DRY" = 1 ]; then
    # Stand-ins: tiny layers with the 1.3B vocabulary (the gpt2 tokenizer path), on CPU.
    DEVICE=cpu
    BIG=(--model tiny --vocab-size 51200)
    PLAN_BIG=(--model tiny)
    BENCH_BIG=(--shapes tiny --batch 2 --warmup 1 --steps 1 --sequential)
    BENCH_SMALL=(--shapes tiny --seq-len 32 --batch 2 --warmup 1 --steps 1 --no-compile
                 --sequential)
    PRETRAIN_SHAPE=(--seq-len 128)
    STEPS=4
    THREADS=2
else
    DEVICE=cuda
    BIG=(--model 1.3b)
    PLAN_BIG=(--model 1.3b)
    BENCH_BIG=(--shapes 1.3b --seq-len 2048 --batch 8 --warmup 2 --steps 8)
    BENCH_SMALL=(--shapes gpt2-small --seq-len 1024 --batch 16 --warmup 2 --steps 8)
    PRETRAIN_SHAPE=()
    STEPS=12
    THREADS=16
fi

# step NAME CAP_SECONDS CMD...: run CMD under a timeout (CAP, or what is left of the budget),
# output to the terminal and $OUT/NAME.log; a failure is reported and the script goes on.
step() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 10 ]; then
        echo "=== $name: skipped, ${left}s of the ${BUDGET}s budget left"
        return
    fi
    echo "=== $name (timeout ${limit}s): $*"
    local begin=$SECONDS rc
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=$?
    echo "=== $name: exit $rc after $((SECONDS - begin))s ($((SECONDS - START))s in all)"
}

echo "=== $(date -u '+%Y-%m-%d %H:%M:%S UTC'), OUT=$OUT, dry=$DRY"
if [ "$DRY" != 1 ]; then
    nvidia-smi --query-gpu=name,memory.total --format=csv
fi
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda",
torch.version.cuda, "| transformers", transformers.__version__)'

# (a) calibrate at the 1.3B shapes, then plan full recompute with the file.
step plan-calibrate 75 "$PY" -m mt_pretrain plan "${PLAN_BIG[@]}" --gpu h200 \
    --micro-batch-size 8 --global-batch-size 8 --recompute none --precision bf16 \
    --calibrate "$CALIB"
PLAN_GPUS=(--plan-gpu h200)
if [ -f "$CALIB" ]; then
    echo "--- $CALIB"
    cat "$CALIB"
    PLAN_GPUS+=(--plan-gpu "$CALIB")
    step plan-full 25 "$PY" -m mt_pretrain plan "${PLAN_BIG[@]}" --gpu "$CALIB" \
        --micro-batch-size 8 --global-batch-size 8 --recompute full --precision bf16
else
    echo "=== no calibration file: predictions use the h200 data sheet only"
fi

# (b) training step benchmark against HF, like for like, one runner at a time.
step train-1.3b 170 "$PY" benchmarks/train.py --device "$DEVICE" --threads "$THREADS" \
    --peak-tflops 989 --precisions bf16 "${BENCH_BIG[@]}" "${PLAN_GPUS[@]}" \
    --json "$OUT/train-1.3b.json"
step train-gpt2-small 90 "$PY" benchmarks/train.py --device "$DEVICE" --threads "$THREADS" \
    --peak-tflops 989 --precisions bf16 "${BENCH_SMALL[@]}" "${PLAN_GPUS[@]}" \
    --json "$OUT/train-gpt2-small.json"

# (c) mt pretrain itself: 12 steps of 1.3B, bf16, micro-batch 8, on the embedded corpus.
step pretrain-1.3b 90 "$PY" -m mt_pretrain pretrain "${BIG[@]}" \
    ${PRETRAIN_SHAPE[@]+"${PRETRAIN_SHAPE[@]}"} --device "$DEVICE" --precision bf16 \
    --micro-batch-size 8 --global-batch-size 8 \
    --train-steps "$STEPS" --out-dir "$OUT/pretrain-1.3b" --overwrite --save none \
    --metrics "$OUT/pretrain-1.3b.jsonl" --log-interval 1 --no-progress \
    --eval-interval 0 --sample-tokens 0 --peak-tflops 989
echo "--- pretrain: last progress lines"
grep -iE "^step|^trained|^memory|peak" "$OUT/pretrain-1.3b.log" 2>/dev/null | tail -n 5
echo "--- pretrain: last metrics line"
tail -n 1 "$OUT/pretrain-1.3b.jsonl" 2>/dev/null
echo

# (d) the same with selective recomputation (fp32 main gradients and the chunked loss are on in
#     both): its peak memory and tokens/s beside (c)'s.
step pretrain-1.3b-selective 70 "$PY" -m mt_pretrain pretrain "${BIG[@]}" \
    ${PRETRAIN_SHAPE[@]+"${PRETRAIN_SHAPE[@]}"} --device "$DEVICE" --precision bf16 \
    --micro-batch-size 8 --global-batch-size 8 --recompute selective \
    --train-steps "$STEPS" --out-dir "$OUT/pretrain-1.3b-selective" --overwrite --save none \
    --metrics "$OUT/pretrain-1.3b-selective.jsonl" --log-interval 1 --no-progress \
    --eval-interval 0 --sample-tokens 0 --peak-tflops 989
tail -n 1 "$OUT/pretrain-1.3b-selective.jsonl" 2>/dev/null
echo

echo "=== done in $((SECONDS - START))s; files in $OUT:"
ls -l "$OUT"
