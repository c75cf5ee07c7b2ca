"""Coverage-guided fuzzing of every decoder with atheris: ``python _sec_atheris.py [libFuzzer flags] CORPUS``.

weightsync's modules are imported under ``instrument_imports`` first, so libFuzzer sees
their branch coverage; the targets are those of _sec_fuzz.py (the first input byte picks
one). An exception other than a WeightsyncError is a crash: atheris prints it and exits
non-zero. Run by test_fuzz.py::test_atheris_coverage_guided when atheris is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

with atheris.instrument_imports(include=["weightsync"]):
    import weightsync.codec.checkpoint  # noqa: F401
    import weightsync.codec.container  # noqa: F401
    import weightsync.codec.encoder  # noqa: F401
    import weightsync.codec.frame  # noqa: F401
    import weightsync.codec.manifest  # noqa: F401
    import weightsync.codec.safetensors  # noqa: F401
    import weightsync.ops.records  # noqa: F401

import _sec_fuzz  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--write-corpus":
        print(_sec_fuzz.write_atheris_corpus(Path(sys.argv[2])))
    else:
        _sec_fuzz.atheris_main(sys.argv)
