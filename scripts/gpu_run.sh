#!/usr/bin/env bash
# Issue 11's GPU run, one command on the lent GPU machine (docs/SCALE.md): wheels the image lacks from
# .whl (benchmarks/README.md says how to fetch them), then the scale bench on the issue's 5.63 GB
# Llama recipe (publish, prepare + apply into live CUDA tensors, end to end, publish_async, keyframe
# publish, GPU staging; full reload warm/cold; XOR + zstd-1), the probe's thread scaling and, with
# CHUNKS=yes, encode and prepare at 4 and 16 MiB frames on all cores (benchmarks/chunk_probe.py).
# Writes what it measured under $OUT (or ./gpu-out) as it goes. Usage: scripts/gpu_run.sh [MODEL_BYTES] [PROBE] [CHUNKS]
# LR (default 5e-6): AdamW's lr of the scale run's model, 5e-6 for issue 11's density (~2-3 % of the elements a
# step, as its 2.75 % case), 1e-6 for run Y's steady steps (0.5-0.7 %). WORKERS (default 1, as run Y): the
# embedded server's worker processes in the scale run (one takes ~0.4 GB/s of uploads: a keyframe's upload
# bound; WORKERS=4 or 8 shows the keyframe publish with that bound lifted).
#
# The whole script keeps within BUDGET seconds (default 570: under the device's 600 s a call, so a session's
# one call brings everything back): each step's timeout is its own or what is left after the steps
# after it are set their minimum, and a step with less than that left is skipped, said so.
# (scripts/gpu_staging.sh, a call of its own: a device's prepare staged from its frames against the reference.)
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
SIZE=${1:-5.63G}
PROBE=${2:-yes}
CHUNKS=${3:-no}
LR=${LR:-5e-6}
WORKERS=${WORKERS:-1}
BUDGET=${BUDGET:-570}
START=$SECONDS
exec 3>&1  # the steps' own lines, past the pipes that cut their output short

# cap WANT RESERVE: WANT seconds, or what is left of the budget less RESERVE (the later steps' share).
cap() {
    local left=$((BUDGET - (SECONDS - START) - $2))
    echo $(($1 < left ? $1 : left))
}
# step NAME WANT RESERVE MIN CMD...: run CMD under the capped timeout, or skip it when under MIN seconds.
step() {
    local name=$1 t
    t=$(cap "$2" "$3")
    if [ "$t" -lt "$4" ]; then
        echo "gpu_run: $name skipped: ${t}s of the ${BUDGET}s budget left" | tee -a "$OUT/skipped.txt" >&3
        return 0
    fi
    shift 4
    echo "gpu_run: $name (up to ${t}s)" >&3
    timeout "$t" "$@"
}

. "$(dirname "$0")/gpu_env.sh"
{ nvidia-smi -L; nproc; free -g | head -2; df -h / /tmp | tail -2; python3 --version; } 2>&1 | tee "$OUT/machine.txt"
python3 -c "from weightsync.codec import kernels; print('kernels:', type(kernels.active()).__name__); import weightsync.service" || exit 1
# The minimum the later steps keep: the probe and the chunk probe 90 s each when asked for.
after_probe=0
[ "$CHUNKS" = yes ] && after_probe=90
later=$after_probe
[ "$PROBE" = yes ] && later=$((later + 90))
# A small model first: a broken run fails in a minute, not eight.
step smoke 150 $((240 + later)) 30 python3 -m benchmarks.scale_bench --model-bytes 300M --versions 3 --out "$OUT" \
    --label smoke_cuda --cache /tmp/ws-cache 2>&1 | tail -4 || exit 1
step scale 360 "$later" 120 python3 -m benchmarks.scale_bench --model-bytes "$SIZE" --lr "$LR" --versions 3 \
    --server-workers "$WORKERS" --out "$OUT" --cache /tmp/ws-cache 2>&1 | tee "$OUT/scale.log"
rm -rf /tmp/ws-cache  # the versions: disk for the probe
if [ "$PROBE" = yes ]; then
    step probe 240 "$after_probe" 60 python3 benchmarks/device_probe.py --hidden 3072 --layers 26 \
        --parts checksum,stream,codec 2>&1 | tail -60
fi
if [ "$CHUNKS" = yes ]; then
    step chunks 200 0 60 python3 -m benchmarks.chunk_probe "$SIZE" --chunks 4M,16M --rounds 3 \
        --out "$OUT/chunk_probe.json" 2>&1 | tail -6
fi
echo "gpu_run: done in $((SECONDS - START))s of ${BUDGET}s"
