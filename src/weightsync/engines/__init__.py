"""Inference engines kept on a model's newest version: one interface, one adapter per engine, one sidecar loop.

- :class:`Engine` (engines/base.py): hold version N, prepare N+1 while serving,
  switch (the only pause), verify, report.
- ``weightsync.engines.vllm.VllmDisk``: a vLLM server reloaded from a checkout,
  every parameter checked against the version (SHA-256), put back on failure.
- ``weightsync.engines.vllm_inprocess.VllmInProcess``: a vLLM server whose
  workers (extension ``weightsync.engines.vllm_worker.Worker``) prepare each
  version while serving and write only the changed elements, checked before
  and after; packed modules reloaded layer-wise.
- ``weightsync.engines.sglang.SglangDisk``: an SGLang server updated from a
  checkout, every parameter checked against the version (SGLang's 64-bit
  hash), put back on failure.
- ``weightsync.engines.layouts``: which checkpoint slices each vLLM
  tensor-parallel rank's parameter holds (for the expected digests and the
  element updates).
- ``weightsync.engines.torch.TorchModule``: an ``nn.Module`` updated in place.
- :func:`follow` (engines/follow.py): the loop ``weightsync follow`` runs.

The adapters are imported on first use: ``import weightsync.engines`` needs
neither torch nor a running engine.
"""

from __future__ import annotations

from weightsync.engines.base import Engine, SwitchReport, Update
from weightsync.engines.errors import (
    EngineError,
    EngineUnavailable,
    EngineUnhealthy,
    SwitchFailed,
    UnverifiableEngine,
)
from weightsync.engines.follow import follow

__all__ = [
    "Engine",
    "EngineError",
    "EngineUnavailable",
    "EngineUnhealthy",
    "SwitchFailed",
    "SwitchReport",
    "UnverifiableEngine",
    "Update",
    "follow",
]
