#!/usr/bin/env bash
# The wheels scripts/gpu_run.sh installs on the lent GPU machine (no network there; Python 3.12): the
# server's and the codec's packages its image lacks, each at the version this checkout's .venv holds,
# fetched here from PyPI into .whl/ (git-ignored through .git/info/exclude). Carry `.whl` and
# `src/weightsync/codec/_kernels.abi3.so` with each run that needs them (benchmarks/README.md, "On the
# H100 box"). Usage: scripts/gpu_wheels.sh (after `make .venv/.installed-stamp`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# Missing from the GPU image's package list (/work/.library/device/KINDS.md), or there at an older
# version than these need (typing-extensions).
NAMES="zstandard cffi pycparser fastapi starlette uvicorn pydantic pydantic-core pydantic-settings sqlalchemy greenlet alembic mako
opentelemetry-api python-dotenv annotated-types typing-inspection typing-extensions"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
for name in $NAMES; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") || {
        echo "gpu_wheels: $name is not installed in $PY's environment" >&2
        exit 1
    }
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
        -d .whl "$name==$version"
done
du -sh .whl
ls .whl
