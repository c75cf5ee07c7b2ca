"""What the tensor-parallel tests do to a host store: flip a changed value that lands on one rank's slice only.

Pure numpy and weightsync (no vLLM): used by ``_vllm_tp.py`` in the vLLM venv and by
``test_vllm_tp.py`` in the main one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from weightsync.engines import layouts
from weightsync.engines.host_store import HostVersion


def flip_one_of_rank(path: Path, config: layouts.ModelConfig, *, rank: int, size: int) -> str:
    """Flip one bit of a changed ``q_proj`` value in ``path/changes.bin`` (a host store version) that lands on
    ``rank``'s slice and no other rank's; the tensor's name."""
    version = HostVersion(path)
    shapes = {n: t.shape for n, t in version.tensors.items()}
    for name in sorted(version.tensors):
        found = version.changes(name) if ".q_proj." in name else None
        if found is None or not len(found[0]):
            continue
        target = layouts.target(name)
        mine = layouts.layout(target, shapes, config, rank=rank, size=size)
        others = [layouts.layout(target, shapes, config, rank=r, size=size) for r in range(size) if r != rank]
        for i, p in enumerate(found[0]):
            one = np.array([p])
            if len(layouts.element_map(mine, name, one)[0]) and not any(
                len(layouts.element_map(o, name, one)[0]) for o in others
            ):
                changes = version.tensors[name].changes
                assert changes is not None
                at, count = changes
                offset = at + 8 * count + version.tensors[name].width * i
                with open(path / "changes.bin", "r+b") as f:
                    f.seek(offset)
                    b = f.read(1)[0]
                    f.seek(offset)
                    f.write(bytes([b ^ 0x10]))
                return name
    raise AssertionError(f"no changed q_proj element of {path} lands on rank {rank} alone")
