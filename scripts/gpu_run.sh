#!/usr/bin/env bash
# Issue 11's GPU run, one command on the lent GPU machine (docs/SCALE.md): wheels the image lacks from
# .whl (benchmarks/README.md says how to fetch them), then the scale bench on the issue's 5.63 GB
# Llama recipe (publish, prepare + apply into live CUDA tensors, end to end, publish_async, keyframe
# publish, GPU staging; full reload warm/cold; XOR + zstd-1), the probe's thread scaling and, with
# CHUNKS=yes, encode and prepare at 4 and 16 MiB frames on all cores (benchmarks/chunk_probe.py).
# Writes what it measured under $OUT (or ./gpu-out). Usage: scripts/gpu_run.sh [MODEL_BYTES] [PROBE] [CHUNKS]
# (scripts/gpu_staging.sh, a call of its own: a device's prepare staged from its frames against the reference.)
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
SIZE=${1:-5.63G}
PROBE=${2:-yes}
CHUNKS=${3:-no}
. "$(dirname "$0")/gpu_env.sh"
{ nvidia-smi -L; nproc; free -g | head -2; df -h / /tmp | tail -2; python3 --version; } 2>&1 | tee "$OUT/machine.txt"
python3 -c "from weightsync.codec import kernels; print('kernels:', type(kernels.active()).__name__); import weightsync.service" || exit 1
# A small model first: a broken run fails in a minute, not eight.
timeout 150 python3 -m benchmarks.scale_bench --model-bytes 300M --versions 3 --out "$OUT" --label smoke_cuda \
    --cache /tmp/ws-cache 2>&1 | tail -4 || exit 1
timeout 360 python3 -m benchmarks.scale_bench --model-bytes "$SIZE" --versions 3 --out "$OUT" --cache /tmp/ws-cache 2>&1 \
    | tee "$OUT/scale.log"
rm -rf /tmp/ws-cache  # the versions: disk for the probe
if [ "$PROBE" = yes ]; then
    timeout 240 python3 benchmarks/device_probe.py --hidden 3072 --layers 26 --parts checksum,stream,codec 2>&1 | tail -60
fi
if [ "$CHUNKS" = yes ]; then
    timeout 200 python3 -m benchmarks.chunk_probe "$SIZE" --chunks 4M,16M --rounds 3 --out "$OUT/chunk_probe.json" 2>&1 \
        | tail -6
fi
