#!/usr/bin/env bash
# A GPU subscriber's `prepare` staged straight from its frames (client/stage_frames.py) against the reference
# path (WEIGHTSYNC_STAGE_FRAMES=0), in process, rounds alternating, on the issue's Llama recipe at 2 and 16
# decode threads (benchmarks/gpu_profile.py --compare): ~2-3 minutes on the lent GPU machine, a call of its
# own after scripts/gpu_run.sh (same wheels in .whl). Writes $OUT/staging.log (or ./gpu-out).
# Usage: scripts/gpu_staging.sh [MODEL_BYTES] [THREADS...]
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
SIZE=${1:-5.63G}
shift || true
THREADS=${*:-2 16}
. "$(dirname "$0")/gpu_env.sh"
for t in $THREADS; do
    echo "== $t decode threads" | tee -a "$OUT/staging.log"
    timeout 200 python3 -m benchmarks.gpu_profile "$SIZE" --compare --rounds 4 --threads "$t" 2>&1 \
        | grep -E "^model|medians|^prepare:|Error|error" | tee -a "$OUT/staging.log"
done
