"""Plain PyTorch / transformers: keep an ``nn.Module`` (or a dict of tensors) on the newest version, in place.

What examples/inference_loop.py does by hand, behind the :class:`Engine`
interface: :meth:`TorchModule.prepare` downloads and decodes the next version
while the module serves (``Subscriber.prepare``); :meth:`TorchModule.switch`
changes only the elements that changed, in the module's own tensors, holding
``lock`` (the caller's serving lock) meanwhile, and checks every changed tensor
before and after (``Subscriber.apply``). A version that cannot be applied in
place (a tensor added or reshaped) is loaded whole instead, when the adapter
has a ``directory`` to pull it into.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync import errors
from weightsync.client.inplace import Prepared
from weightsync.client.subscriber import Subscriber
from weightsync.client.tensors import load, torch_module
from weightsync.engines.base import Engine, SwitchReport, Update


@dataclass(frozen=True)
class TensorUpdate(Update):
    """A version decoded into per-tensor changes, ready to apply in place."""

    prepared: Prepared


class TorchModule(Engine):
    """An ``nn.Module``'s tensors (``state_dict()``: parameters and buffers, shared storage) or a name → tensor
    mapping, kept on ``subscriber``'s model.

    ``subscriber.version`` must say which version the tensors hold (None: they
    hold none yet; :meth:`load` fills them). ``device`` stages prepared changes
    there (e.g. ``"cuda:0"``) so the switch moves nothing across the bus.
    ``strict=False`` skips version tensors the module does not have.
    """

    kind = "torch"
    reports_itself = True  # Subscriber.apply reports each in-place update to the ledger

    def __init__(
        self,
        module: Any,
        subscriber: Subscriber,
        *,
        directory: str | os.PathLike[str] | None = None,
        device: Any = None,
        strict: bool = True,
        lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        torch = torch_module()
        if isinstance(module, torch.nn.Module):
            self.tensors: dict[str, Any] = dict(module.state_dict())
        elif isinstance(module, Mapping):
            self.tensors = dict(module)
        else:
            raise errors.InvalidArgument(f"TorchModule takes an nn.Module or a mapping of tensors, not {type(module)}")
        self.subscriber = subscriber
        subscriber.engine = self.kind  # its own reports of each in-place update name this engine
        self.directory = Path(directory) if directory is not None else None
        self.device = device
        self.strict = strict
        self.lock = lock if lock is not None else threading.Lock()
        self.version = subscriber.version

    def held(self) -> int | None:
        """The version the tensors hold: every in-place change is checked against its digests, so the
        subscriber's record is the tensors' (they live in this process: nothing else changes them)."""
        self.version = self.subscriber.version
        return self.version

    def load(self, version: int | None = None) -> SwitchReport:
        """Fill the tensors with ``version`` (default: the head) whole: the first version a process holds."""
        if version is None:
            head = self.subscriber.api.head(self.subscriber.model)
            if head is None:
                raise errors.VersionNotFound(f"{self.subscriber.model} has no version yet")
            version = head.number
        saved = self.subscriber.version
        self.subscriber.version = None  # a plan from nothing: whole-tensor replacements
        try:
            return self.switch(self.prepare(version))
        except BaseException:
            self.subscriber.version = saved
            raise

    def prepare(self, version: int) -> TensorUpdate:
        """Download and decode ``version``'s changes (``Subscriber.prepare``) while the module serves."""
        prepared = self.subscriber.prepare(version, device=self.device)
        return TensorUpdate(prepared.target, prepared.bytes_received, prepared.seconds, prepared)

    def switch(self, update: Update) -> SwitchReport:
        """Apply ``update`` in place under ``lock``; a version that needs new tensors is reloaded whole."""
        if not isinstance(update, TensorUpdate):
            raise errors.InvalidArgument("TorchModule.switch takes the TensorUpdate its prepare returned")
        previous = self.version
        t0 = time.perf_counter()
        try:
            with self.lock:
                pause = self.subscriber.apply(self.tensors, update.prepared, strict=self.strict)
        except errors.ReloadRequired:
            if self.directory is None:
                raise
            return self._reload(update.version, previous)
        self.version = update.version
        return SwitchReport(
            update.version,
            previous,
            pause,
            "in-place",
            len(update.prepared.updates),
            update.bytes_received,
            update.prepare_s,
            {"apply_s": time.perf_counter() - t0},
            update.prepared.changed_elements,
        )

    def _reload(self, version: int, previous: int | None) -> SwitchReport:
        """Pull ``version`` into the directory and copy every tensor in (shapes may have changed: rebinds)."""
        t0 = time.perf_counter()
        assert self.directory is not None
        pulled = self.subscriber.pull(self.directory, version)
        fresh = load(self.directory)
        t1 = time.perf_counter()
        with self.lock:
            for name, value in fresh.items():
                held = self.tensors.get(name)
                if held is not None and held.shape == value.shape and held.dtype == value.dtype:
                    held.copy_(value)
                else:
                    self.tensors[name] = value.to(self.device) if self.device is not None else value
        pause = time.perf_counter() - t1
        self.version = pulled.version
        return SwitchReport(
            pulled.version,
            previous,
            pause,
            "reload",
            len(fresh),
            pulled.bytes_received,
            t1 - t0,
            {"load_s": t1 - t0},
        )
