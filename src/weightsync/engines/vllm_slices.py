"""vLLM in-process mode with tensor parallelism > 1: one rank's parameters as slices of checkpoint tensors.

Each vLLM worker of a tensor-parallel group holds, for every parameter, its
rank's slice (``engines/layouts.py``: column, row, merged, qkv with key/value
heads replicated, vocabulary padded, replicated). :class:`Sliced` is what the
worker extension (``engines/vllm_worker.py``) keeps on such a rank:

- **prepare** (in a thread, while the engine serves): the version comes from
  the host store (``engines/host_store.py``: one worker per host downloads and
  decodes it, the others wait on the host's lock and read it). For each
  parameter one of whose checkpoint tensors changed, the changed elements the
  store recorded are mapped onto this rank's slice (:func:`layouts.element_map`;
  elements of other ranks' slices are left out), and the checksum of the
  rank's slice of the new version is computed from the version's data (FORMAT
  §10, summed piece by piece in the parameter's order: :func:`expected_sum`).
  When the store's changes are not from the version this rank holds (it lags,
  or holds none), the rank's slice of the new version is compared with the live
  slice instead (the same elements, found by reading both).
- **switch** (paused by the caller): every parameter about to change is
  checksummed where it lives and compared with the checksum of the held
  version's slice (base); then only the mapped elements are written, each read
  back, and the slice's checksum is moved by the changed elements (the
  checksum is linear) and compared with the new version's (result). A failed
  result undoes every write of the switch: the rank holds its version as before
  (and the store's copy of the version is dropped, so the next prepare makes it
  again). When another rank of the engine failed its switch, :meth:`Sliced.revert`
undoes this rank's last one (the adapter asks every worker), so the whole engine
holds the previous version again. A failed base check leaves the rank holding no version; the next
  switch rewrites every element that differs from the version, each parameter's
  result summed in full.

Only parameters whose rank slice has the checkpoint's dtype and the layout's
shape are updated; any other parameter the checkpoint feeds (quantized,
repacked) is refused at attach (UnverifiableEngine: disk mode serves those).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightsync import errors
from weightsync.client.subscriber import Subscriber
from weightsync.codec.checksum import TensorSum, change_lanes, tensor_sum
from weightsync.engines import layouts
from weightsync.engines.errors import UnverifiableEngine
from weightsync.engines.host_store import HostStore, HostVersion

COUNTERS = ("switches", "failed", "elements", "tensors_in_place", "tensors_reloaded", "reloads", "attach_reloads")
"""What every worker counts (``weightsync_stats``); a tensor-parallel rank counts its host store's use too."""


@dataclass(frozen=True)
class Slice:
    """One engine parameter on this rank: its tensor (the rank's slice) and where its elements come from."""

    name: str
    param: Any
    layout: layouts.Layout


def plan_slices(
    net: Any, version: HostVersion, config: layouts.ModelConfig, *, rank: int, size: int
) -> tuple[dict[str, Slice], list[str]]:
    """Every parameter of ``net`` the version's tensors feed, as a :class:`Slice` of ``rank`` of ``size``; and the
    checkpoint tensors no parameter takes. UnverifiableEngine naming a parameter that cannot be updated in place."""
    from weightsync.client.tensors import torch_dtype

    shapes = {n: t.shape for n, t in version.tensors.items()}
    out: dict[str, Slice] = {}
    fed: set[str] = set()
    for name, param in net.named_parameters():
        parts = [s for s in layouts.sources(name) if s in shapes]
        if not parts:
            continue  # no checkpoint source (computed by the loader): nothing to update
        lay = layouts.layout(name, shapes, config, rank=rank, size=size)
        dtypes = {version.tensors[s].dtype for s, _ in lay.sources}
        data = param.data
        if (
            len(dtypes) != 1
            or data.dtype != torch_dtype(dtypes.pop())
            or tuple(data.shape) != tuple(lay.shape)
            or not data.is_contiguous()
        ):
            want = sorted({version.tensors[s].dtype for s, _ in lay.sources})
            raise UnverifiableEngine(
                f"engine parameter {name!r} on tensor-parallel rank {rank} of {size} is {data.dtype}"
                f"{list(data.shape)}, not its checkpoint slice {want}{list(lay.shape)}: in-process mode updates "
                "such engines in place only (use disk mode)"
            )
        fed.update(s for s, _ in lay.sources)
        out[name] = Slice(name, data, lay)
    return out, sorted(set(shapes) - fed)


def expected_sum(s: Slice, version: HostVersion) -> TensorSum:
    """The checksum of this rank's slice of ``s`` in ``version``, from the version's data (padding: zeros)."""
    width = s.param.element_size()
    total, at = TensorSum.empty(width), 0
    for chunk in layouts.chunks(s.layout, {src: version.array(src) for src, _ in s.layout.sources}):
        total = total + tensor_sum(np.ascontiguousarray(chunk).view(np.uint8).reshape(-1), width, start=at)
        at += chunk.size
    return total


def live_sums(slices: Sequence[Slice]) -> list[TensorSum]:
    """The checksum of each slice's tensor, computed where it lives (client/verify.py)."""
    from weightsync.client.verify import checksums

    hexes = checksums([s.param for s in slices]).digests
    return [TensorSum.from_digest(s.param.element_size(), bytes.fromhex(h)) for s, h in zip(slices, hexes, strict=True)]


@dataclass
class SliceChange:
    """What a switch writes into one parameter slice: flat positions, new element values, the result's checksum."""

    name: str
    where: np.ndarray
    values: np.ndarray
    expected: TensorSum
    mapped: bool
    """True: from the changes the host store recorded (element_map); False: found by comparing with the live slice."""


def slice_change(s: Slice, version: HostVersion, held: int | None) -> SliceChange:
    """The elements of ``s`` that differ between the version ``held`` (what the slice holds) and ``version``."""
    mapped = held is not None and version.base == held and all(version.changed(src) for src, _ in s.layout.sources)
    if mapped:
        wheres, values = [], []
        for src, _ in s.layout.sources:
            found = version.changes(src)
            assert found is not None
            positions, new = found
            which, where = layouts.element_map(s.layout, src, positions)
            wheres.append(where)
            values.append(new[which])
        where_all = np.concatenate(wheres) if wheres else np.zeros(0, np.int64)
        value_all = np.concatenate(values) if values else np.zeros(0, np.uint8)
        where_all, first = np.unique(where_all, return_index=True)  # an element held twice is written once
        value_all = value_all[first]
    else:
        want = layouts.gather(s.layout, {src: version.array(src) for src, _ in s.layout.sources}).reshape(-1)
        live = _host_ints(s.param)
        where_all = np.flatnonzero(want != live.view(want.dtype)).astype(np.int64)
        value_all = want[where_all]
    return SliceChange(s.name, where_all, np.ascontiguousarray(value_all), expected_sum(s, version), mapped)


def _host_ints(t: Any) -> np.ndarray:
    from weightsync.client.tensors import int_view

    return int_view(t).cpu().numpy() if t.device.type != "cpu" else int_view(t).numpy()


def _write(t: Any, where: np.ndarray, values: np.ndarray) -> tuple[Any, tuple[int, ...]]:
    """Write ``values`` at flat positions ``where`` of ``t`` where it lives; the old values and how the checksum
    lanes moved (each element read back after its write)."""
    from weightsync.client.tensors import int_view

    if t.device.type == "cpu":
        view = int_view(t).numpy()
        before = view[where].copy()
        view[where] = values.view(view.dtype)
        return before, change_lanes(before, view[where], where, t.element_size())
    import torch

    from weightsync import devsum

    flat = int_view(t)
    index = torch.from_numpy(where).to(t.device)
    before = flat[index].clone()
    flat[index] = torch.from_numpy(values.view(_signed(values))).to(t.device)
    return before, devsum.lanes_to_ints(devsum.change_lanes(before, flat[index], index))


def _undo(t: Any, where: np.ndarray, before: Any) -> None:
    from weightsync.client.tensors import int_view

    if t.device.type == "cpu":
        int_view(t).numpy()[where] = before
        return
    import torch

    int_view(t)[torch.from_numpy(where).to(t.device)] = before


def _signed(a: np.ndarray) -> np.dtype[Any]:
    return np.dtype(f"<i{a.dtype.itemsize}")


@dataclass
class Prepared:
    """A version prepared on this rank: the changes of its slices, and what making it cost."""

    target: int
    base: int | None
    """The version the rank held when this was prepared: what the changes apply to."""
    changes: list[SliceChange]
    digests: dict[str, str]
    """Digest of each checkpoint tensor of the target version (what the rank holds after the switch)."""
    made_here: bool
    bytes: int
    seconds: float

    @property
    def elements(self) -> int:
        return sum(len(c.where) for c in self.changes)


@dataclass
class _Undo:
    """What the last successful switch changed, to put back when another rank of the engine failed its switch."""

    target: int
    previous: int | None
    sums: dict[str, TensorSum]
    digests: dict[str, str]
    writes: list[tuple[SliceChange, Slice, Any]]


@dataclass
class Sliced:
    """One tensor-parallel rank's in-process state (module docstring). One call at a time, as vLLM makes them."""

    subscriber: Subscriber
    store: HostStore
    net: Any
    config: layouts.ModelConfig
    rank: int
    size: int
    slices: dict[str, Slice] = field(default_factory=dict)
    unmapped: list[str] = field(default_factory=list)
    held: int | None = None
    sums: dict[str, TensorSum] = field(default_factory=dict)
    """Checksum of each slice in the held version (verified against the live slice when it was reached)."""
    digests: dict[str, str] = field(default_factory=dict)
    """Digest of each checkpoint tensor of the held version."""
    preparing: threading.Thread | None = None
    prepared: Prepared | None = None
    prepare_error: BaseException | None = None
    target: int | None = None
    undo: _Undo | None = None
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys((*COUNTERS, "host_made", "host_read", "reverted"), 0)
    )

    # --- attach -----------------------------------------------------------------------------

    def prove(self, candidates: Sequence[int]) -> bool:
        """Hold the first of ``candidates`` whose slices the live parameters are (each checked by its checksum)."""
        live: dict[str, TensorSum] | None = None
        for number in dict.fromkeys(int(c) for c in candidates):
            try:
                version, made = self.store.get(self.subscriber, number)
            except errors.VersionNotFound:
                continue
            self._count(made)
            slices, unmapped = plan_slices(self.net, version, self.config, rank=self.rank, size=self.size)
            if live is None or slices.keys() != self.slices.keys():
                live = dict(zip(slices, live_sums(list(slices.values())), strict=True))
            want = {n: expected_sum(s, version) for n, s in slices.items()}
            self.slices, self.unmapped = slices, unmapped
            if want == live:
                self.held, self.sums = number, want
                self.digests = {n: t.digest for n, t in version.tensors.items()}
                self.subscriber.version = number
                return True
        return False

    def _count(self, made: bool) -> None:
        self.counters["host_made" if made else "host_read"] += 1

    # --- status -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        prepared, failure = self.prepared, self.prepare_error
        ready = prepared is not None and self.preparing is None
        return {
            "held": self.held,
            "target": self.target,
            "ready": ready,
            "bytes": prepared.bytes if ready and prepared is not None and prepared.made_here else 0,
            "prepare_s": prepared.seconds if ready and prepared is not None else 0.0,
            "prepare_error": None
            if failure is None
            else {"error": type(failure).__name__, "message": str(failure).replace("\n", " ")},
            "in_place": sorted(self.slices),
            "reload": [],
            "unmapped": list(self.unmapped),
            "counters": dict(self.counters),
            "rank": self.rank,
            "size": self.size,
            "host_dir": str(self.store.dir),
            "made_here": bool(ready and prepared is not None and prepared.made_here),
            "changed_elements": prepared.elements if ready and prepared is not None else 0,
        }

    def sha256(self) -> dict[str, str]:
        """SHA-256 of each slice's bytes, keyed as ``/weight_checker`` answers are read (``tp<rank>/<size>:name``)."""
        from weightsync.engines.digests import rank_key

        return {
            rank_key(n, self.rank, self.size): hashlib.sha256(_host_ints(s.param).tobytes()).hexdigest()
            for n, s in self.slices.items()
        }

    # --- prepare ----------------------------------------------------------------------------

    def start_prepare(self, version: int) -> None:
        """Prepare ``version`` in a thread (module docstring); :meth:`status` says when it is ready."""
        if self.preparing is not None:
            self.preparing.join()
        self.prepared, self.prepare_error, self.target = None, None, int(version)
        held, digests = self.held, dict(self.digests)

        def run() -> None:
            try:
                self.prepared = self._prepare(int(version), held, digests)
            except Exception as exc:  # noqa: BLE001 - answered by status and switch
                self.prepare_error = exc
            finally:
                self.preparing = None

        self.preparing = threading.Thread(target=run, name="weightsync-prepare", daemon=True)
        self.preparing.start()

    def _prepare(self, number: int, held: int | None, digests: Mapping[str, str]) -> Prepared:
        t0 = time.perf_counter()
        version, made = self.store.get(self.subscriber, number)
        self._count(made)
        changes = []
        for name, s in self.slices.items():
            srcs = [src for src, _ in s.layout.sources]
            if any(src not in version.tensors for src in srcs):
                raise errors.ReloadRequired(f"v{number} lacks a checkpoint tensor of {name!r}: load the version afresh")
            if held is not None and all(digests.get(src) == version.tensors[src].digest for src in srcs):
                continue  # none of its tensors changed
            changes.append(slice_change(s, version, held))
        return Prepared(
            number,
            held,
            changes,
            {n: t.digest for n, t in version.tensors.items()},
            made,
            version.bytes,
            time.perf_counter() - t0,
        )

    # --- switch -----------------------------------------------------------------------------

    def switch(self, version: int) -> dict[str, Any]:
        """Write the prepared ``version``'s changed elements into this rank's slices, checked (module docstring)."""
        if self.preparing is not None:
            self.preparing.join()
        if self.prepare_error is not None:
            exc, self.prepare_error = self.prepare_error, None
            raise exc
        prepared = self.prepared
        if prepared is None or prepared.target != int(version):
            raise errors.InvalidArgument(f"version {version} was not prepared in this worker")
        if prepared.base != self.held:
            self.prepared = None
            raise errors.InvalidArgument(
                f"version {version} was prepared on rank {self.rank} from v{prepared.base}, which it no longer "
                f"holds (v{self.held}): prepare it again"
            )
        previous = self.held
        work = [(c, self.slices[c.name]) for c in prepared.changes if len(c.where) or c.name not in self.sums]
        t0 = time.perf_counter()
        bases = {c.name: self.sums[c.name] for c, _ in work if c.name in self.sums and self.held is not None}
        checked = [(c, s) for c, s in work if c.name in bases]
        for (c, _), got in zip(checked, live_sums([s for _, s in checked]), strict=True):
            if got != bases[c.name]:
                self._fail(unknown=True)
                raise errors.BaseMismatch(
                    f"parameter {c.name!r} on rank {self.rank} does not hold v{previous}'s slice; nothing was changed"
                )
        done: list[tuple[SliceChange, Slice, Any]] = []
        bad: str | None = None
        for c, s in work:
            before, lanes = _write(s.param, c.where, c.values)
            done.append((c, s, before))
            if c.name in bases and bases[c.name].moved(lanes) != c.expected:
                bad = c.name
                break
        if bad is None:
            rest = [(c, s) for c, s in work if c.name not in bases]
            for (c, _), got in zip(rest, live_sums([s for _, s in rest]), strict=True):
                if got != c.expected:
                    bad = c.name
                    break
        if bad is not None:
            for c, s, before in reversed(done):
                _undo(s.param, c.where, before)
            self._fail(unknown=previous is None)
            self.store.drop(prepared.target)  # the host's copy gave a wrong slice: made again by the next prepare
            raise errors.ChecksumMismatch(
                f"parameter {bad!r} on rank {self.rank} of {self.size} does not match v{prepared.target}'s slice "
                f"after the update; every change was undone: this rank holds v{previous} again"
            )
        t1 = time.perf_counter()
        self.undo = _Undo(prepared.target, previous, dict(self.sums), dict(self.digests), done)
        for c, _ in work:
            self.sums[c.name] = c.expected
        self.held, self.digests, self.prepared, self.target = prepared.target, prepared.digests, None, None
        self.subscriber.version = prepared.target
        written = sum(len(c.where) for c, _ in work)
        k = self.counters
        k["switches"] += 1
        k["elements"] += written
        k["tensors_in_place"] += len(work)
        return {
            "version": prepared.target,
            "previous": previous,
            "elements": written,
            "tensors_in_place": len(work),
            "tensors_reloaded": 0,
            "modules_reloaded": 0,
            "apply_s": t1 - t0,
            "reload_s": 0.0,
            "bytes": prepared.bytes if prepared.made_here else 0,
            "prepare_s": prepared.seconds,
            "rank": self.rank,
            "written": {c.name: len(c.where) for c, _ in work},
            "compared": sorted(c.name for c, _ in work if not c.mapped),
        }

    def revert(self, version: int) -> None:
        """Put back the previous version after the switch to ``version`` (another rank of the engine failed its
        own): every write of that switch undone, each parameter's slice checksummed again against the previous
        version's. A no-op unless this rank's last switch was to ``version`` and it still holds it."""
        undo = self.undo
        if undo is None or undo.target != int(version) or self.held != int(version):
            return
        self.undo = None
        for c, s, before in reversed(undo.writes):
            _undo(s.param, c.where, before)
        checked = [(c, s) for c, s, _ in undo.writes if c.name in undo.sums]
        for (c, _), got in zip(checked, live_sums([s for _, s in checked]), strict=True):
            if got != undo.sums[c.name]:
                self._fail(unknown=True)
                raise errors.ChecksumMismatch(
                    f"parameter {c.name!r} on rank {self.rank} is not v{undo.previous}'s slice after the revert: "
                    "this rank holds no verified version"
                )
        if len(checked) < len(undo.writes) or undo.previous is None:
            self._fail(unknown=True)  # a slice with no known previous checksum cannot be proven put back
            return
        self.held, self.sums, self.digests = undo.previous, undo.sums, undo.digests
        self.subscriber.version = undo.previous
        self.counters["reverted"] += 1

    def _fail(self, *, unknown: bool) -> None:
        self.counters["failed"] += 1
        self.prepared = None
        if unknown:
            self.held, self.sums, self.digests = None, {}, {}
            self.subscriber.version = None

    def close(self) -> None:
        if self.preparing is not None:
            self.preparing.join()
        self.subscriber.close()


__all__ = ["Prepared", "Slice", "SliceChange", "Sliced", "expected_sum", "live_sums", "plan_slices", "slice_change"]
