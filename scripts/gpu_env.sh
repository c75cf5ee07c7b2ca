# Sourced by scripts/gpu_run.sh and scripts/gpu_staging.sh on the lent GPU machine: the wheels its image lacks,
# from .whl (scripts/gpu_wheels.sh fetches them), into /tmp/site, and PYTHONPATH for this checkout.
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:src:.
else
    export PYTHONPATH=src:.
fi
