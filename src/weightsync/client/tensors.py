"""torch tensors ⇄ safetensors bytes, and in-place updates of tensors on any device.

torch is imported lazily, only by the functions here that need it: the rest of
the SDK works without it. In-place updates view a tensor as the signed integer
type of its element width and change elements with index ops on the tensor's
own device (two's-complement addition wraps, so zigzag differences apply
exactly); only the small (positions, operands) arrays cross to the device.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from weightsync import errors
from weightsync.codec import safetensors
from weightsync.codec.frame import xxh3_128

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.codec.values import Change

log = logging.getLogger(__name__)

# safetensors dtype name -> torch attribute name (sub-byte packed dtypes are not tensors of their own).
_TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "F8_E8M0": "float8_e8m0fnu",
}
_INT_OF_WIDTH = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def torch_module() -> Any:
    """The torch module, imported on first use (WeightsyncError naming the package when it is missing)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - depends on the environment
        raise errors.WeightsyncError("this needs torch: pip install torch (see the README)") from None
    return torch


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; UnsupportedDtype if torch has none."""
    torch = torch_module()
    attr = _TORCH_NAMES.get(name)
    if attr is None or not hasattr(torch, attr):
        raise errors.UnsupportedDtype(f"no torch dtype for {name}")
    return getattr(torch, attr)


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype; UnsupportedDtype if it has none."""
    torch = torch_module()
    for name, attr in _TORCH_NAMES.items():
        if getattr(torch, attr, None) == dtype:
            return name
    raise errors.UnsupportedDtype(f"torch dtype {dtype} has no safetensors name")


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a 1-D uint8 numpy array (a view for contiguous CPU tensors, else a host copy)."""
    if t.is_cpu and t.is_contiguous():
        return host_bytes(t)
    torch = torch_module()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # xxh3 and serialization run on the host: device tensors are copied there
    t = t.contiguous()
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable 1-D uint8 view of a contiguous CPU tensor's bytes, which keeps the tensor alive.

    :func:`raw_bytes` of such a tensor, without torch's dispatcher: built from the tensor's address
    and size (~1.3 µs against ~5.5 through torch's views, which counts at tens of thousands of tensors
    per apply). The caller checks `t` is a contiguous CPU tensor (ValueError otherwise).
    """
    if not (t.is_cpu and t.is_contiguous()):
        raise ValueError("host_bytes needs a contiguous CPU tensor")
    n = t.nbytes
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    buf = (ctypes.c_uint8 * n).from_address(t.data_ptr())
    buf._tensor = t  # type: ignore[attr-defined]  # the view's buffer owns a reference: the bytes outlive no one
    return np.frombuffer(memoryview(buf), dtype=np.uint8)


def tensor_xxh3(t: torch.Tensor) -> str:
    """xxh3-128 hex of a tensor's bytes, as the manifest records segments.

    CPU tensors are hashed where they lie; device tensors stream to the host
    through pinned staging buffers (client/verify.py, which also hashes many
    tensors at once: use it for more than one).
    """
    if t.device.type == "cpu":
        return xxh3_128(raw_bytes(t)).hex()
    from weightsync.client.verify import HostHasher  # verify builds on this module

    return HostHasher().hash([t]).digests[0]


def serialize_state_dict(state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> np.ndarray:
    """A safetensors file (as a uint8 array) holding `state_dict`'s tensors in its order, exactly as stored.

    Tensors are copied to host memory now, so the caller may keep training.
    bf16 and fp8 bytes are taken through a uint8 view: no conversion. The same
    bytes as :func:`snapshot_state_dict`, into a fresh (pageable) buffer.
    """
    return snapshot_state_dict(state_dict, metadata)


class SnapshotBuffers:
    """Host buffers for state_dict snapshots, reused across snapshots of the same size.

    A buffer is pinned when the snapshot has CUDA tensors (and CUDA is
    available): device→host copies into pinned memory run asynchronously at
    PCIe speed, pageable ones at ~2 GB/s. Pinning is slow (a second or more
    per GB-scale buffer), so buffers are kept: a snapshot's array holds its
    buffer until the last view of it is gone (the publish that uploads it,
    then the publisher's in-memory base), and the buffer then returns here for
    the next snapshot of the same size. At most ``keep`` idle buffers are kept.

    Host cost in a publisher without a cache directory: two model sizes,
    steady state — the snapshot being published and the previous one, which
    the publisher keeps as its base (it adopts the snapshot; no second copy) —
    plus one per publish still queued. torch's caching host allocator rounds
    pinned allocations up to a power of two on some versions. Thread-safe.
    """

    def __init__(self, keep: int = 2) -> None:
        if keep < 0:
            raise ValueError("keep must be >= 0")
        self.keep = keep
        self.allocated = 0
        """Buffers allocated so far (a reused buffer does not count)."""
        self._free: list[tuple[Any, bool]] = []  # (uint8 torch tensor, pinned), oldest first
        self._lock = threading.Lock()

    @property
    def idle(self) -> int:
        """Buffers waiting for reuse."""
        with self._lock:
            return len(self._free)

    def lease(self, nbytes: int, *, pinned: bool) -> tuple[np.ndarray, Any]:
        """(array, tensor): a host buffer of `nbytes` as a numpy array and a torch tensor sharing its memory.

        The buffer comes back to this pool once the array and every view of it are gone.
        """
        torch = torch_module()
        with self._lock:
            found = next((k for k, (t, p) in enumerate(self._free) if t.numel() == nbytes and p == pinned), None)
            buf = self._free.pop(found)[0] if found is not None else None
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            with self._lock:
                self.allocated += 1
        owner = _Lease(buf)
        # numpy records `owner` as the base of the array and of every view of it (bases collapse to the
        # first non-array object): `owner` lives exactly as long as something can read the buffer.
        array = np.asarray(owner)
        weakref.finalize(owner, self._give_back, buf, pinned)
        return array, buf

    def _give_back(self, buf: Any, pinned: bool) -> None:
        with self._lock:
            self._free.append((buf, pinned))
            del self._free[: max(0, len(self._free) - self.keep)]  # the oldest go: torch frees them


class _Lease:
    """Exposes a host torch tensor's bytes to numpy, and keeps the tensor alive while numpy uses them."""

    __slots__ = ("__array_interface__", "__weakref__", "tensor")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.__array_interface__ = {
            "shape": (int(tensor.numel()),),
            "typestr": "|u1",
            "data": (int(tensor.data_ptr()), False),
            "version": 3,
        }


def snapshot_state_dict(
    state_dict: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    buffers: SnapshotBuffers | None = None,
    threads: int | None = None,
) -> np.ndarray:
    """A consistent host copy of `state_dict`, laid out as its safetensors file (:func:`serialize_state_dict`'s bytes).

    When this returns, every byte has landed: the caller may change its tensors.
    CUDA tensors are copied on a side stream that first waits for the current
    stream (the snapshot sees every write queued before the call), into a
    pinned buffer from `buffers` (asynchronous copies at PCIe speed, all
    tensors in flight at once; then one wait). GPU memory cost: a temporary
    contiguous copy of non-contiguous tensors only. CPU tensors are copied by
    `threads` threads (default: all cores). Without `buffers` the buffer is a
    fresh pageable one (device copies then run at pageable speed).
    """
    torch = torch_module()
    specs = []
    tensors = []
    for name, t in state_dict.items():
        if not isinstance(name, str):
            raise TypeError("state_dict keys must be strings")
        t = t.detach()
        specs.append((name, dtype_name(t.dtype), tuple(int(d) for d in t.shape), t.numel() * t.element_size()))
        tensors.append(t)
    header = safetensors.serialize_header(specs, dict(metadata) if metadata is not None else {"format": "pt"})
    total = len(header) + sum(s[3] for s in specs)
    cuda = any(t.is_cuda for t in tensors) and torch.cuda.is_available()
    if buffers is not None:
        out, host = buffers.lease(total, pinned=cuda)
    else:
        out = np.empty(total, dtype=np.uint8)
        host = torch.from_numpy(out)
    out[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    on_host: list[tuple[Any, int]] = []
    on_device: dict[Any, list[tuple[Any, int]]] = {}
    pos = len(header)
    for t, spec in zip(tensors, specs, strict=True):
        if spec[3]:
            (on_host if t.device.type == "cpu" else on_device.setdefault(t.device, [])).append((t, pos))
        pos += spec[3]
    fences: list[Any] = []
    keep: list[Any] = []  # temporaries the in-flight copies read: alive until the copies landed
    try:
        for device, items in on_device.items():
            if device.type == "cuda" and cuda:
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for t, at in items:
                        src = byte_view(t.contiguous())
                        keep.append(src)
                        host[at : at + src.numel()].copy_(src, non_blocking=buffers is not None)
                    event = torch.cuda.Event()
                    event.record(stream)
                fences.append(event)
            else:
                for t, at in items:  # other devices: synchronous copies
                    src = byte_view(t.contiguous())
                    host[at : at + src.numel()].copy_(src)
        _copy_host(out, on_host, threads)  # runs while the device copies are in flight
    finally:
        for event in fences:
            event.synchronize()  # also on failure: no copy may land in a buffer that goes back to the pool
    return out


_PIECE = 64 << 20
"""CPU tensors are copied in pieces of at most this many bytes, so one large tensor spreads over threads."""


def copy_pieces(pairs: list[tuple[np.ndarray, np.ndarray]], pool: Executor | None, *, piece: int = _PIECE) -> None:
    """Copy each (destination, source) pair of equal-length byte arrays (ValueError if not), in pieces of at most
    `piece` bytes.

    On `pool`, the calling thread helping (None: on the calling thread). numpy's copy
    releases the GIL and, unlike torch's ``copy_``, starts no intra-op threads of its own:
    those oversubscribe the cores this pool uses, and after each copy OpenMP's worker spins
    on a core for milliseconds (GOMP_SPINCOUNT: ~18 ms on a Xeon whose ``pause`` takes ~140
    cycles), taking it from whatever runs next (docs/SCALE-RUNS.md, run T).
    """
    from weightsync.client._pool import run_all

    if any(len(dst) != len(src) for dst, src in pairs):
        raise ValueError("copy_pieces: a destination and its source differ in length")
    pieces = [(dst[k : k + piece], src[k : k + piece]) for dst, src in pairs for k in range(0, len(src), piece)]
    if pool is None or len(pieces) < 2:
        for dst, src in pieces:
            np.copyto(dst, src)
        return
    run_all(pool, lambda p: np.copyto(p[0], p[1]), pieces, caller_helps=True)


def _copy_host(out: np.ndarray, items: list[tuple[Any, int]], threads: int | None) -> None:
    """Copy CPU tensors' bytes into `out` at their offsets, on `threads` threads (default: all cores)."""
    pairs = [(out[at : at + t.nbytes], raw_bytes(t)) for t, at in items]
    workers = min(sum(-(-len(src) // _PIECE) for _, src in pairs), threads or os.cpu_count() or 1)
    if workers <= 1:
        copy_pieces(pairs, None)
        return
    with ThreadPoolExecutor(workers - 1, thread_name_prefix="weightsync-snapshot") as pool:  # the caller helps
        copy_pieces(pairs, pool)


def load(path: str | os.PathLike, *, device: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of all `*.safetensors` under a directory, as writable tensors."""
    torch = torch_module()
    root = Path(path)
    files = sorted(p for p in root.rglob("*.safetensors") if ".weightsync" not in p.parts) if root.is_dir() else [root]
    out: dict[str, Any] = {}
    for p in files:
        data = p.read_bytes()
        layout = safetensors.parse(data[: safetensors.header_length(data[:8], len(data))], len(data))
        for span in layout.tensors:
            buf = bytearray(data[span.start : span.end])
            t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.zeros(0, dtype=torch.uint8)
            t = t.view(torch_dtype(span.dtype.name)).reshape(span.shape)
            if span.name in out:
                raise errors.FormatError(f"tensor {span.name!r} appears in more than one file")
            out[span.name] = t.to(device) if device else t
    return out


def int_view(t: torch.Tensor) -> torch.Tensor:
    """A flat view of `t` as the signed integer type of its element width, sharing storage.

    Signed at every width, as ``codec.values.Change`` operands are: addition wraps (two's complement).
    """
    torch = torch_module()
    return t.detach().view(-1).view(getattr(torch, _INT_OF_WIDTH[t.element_size()]))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat view of `t`'s bytes (uint8), sharing storage."""
    torch = torch_module()
    return t.detach().view(-1).view(torch.uint8)


BLOCK_BITS = 16
"""Staged positions are kept as their low 16 bits within blocks of 2^16 elements, plus a count per block."""
APPLY_CHUNK = 1 << 20
"""Changes applied per step: the positions expanded for a step (4 bytes each) are bounded by this."""


@dataclass
class StagedChange:
    """A :class:`~weightsync.codec.values.Change` on the device that applies it, in few bytes per element.

    Positions are block-coded when that is smaller: each as an int16 of its low bits
    (``low``) and, per block of 2^16 elements that has changes, its id and count: 2 bytes
    per changed element plus 8 per such block. Else (a few changes per block) they are
    int32 (int64 for tensors of 2^31 elements or more). Operands keep the element width,
    so a bf16 change costs ~4 bytes staged instead of 10 (int64 positions). `apply`
    expands at most APPLY_CHUNK positions at a time.
    """

    add: bool
    operands: Any
    positions: Any | None = None
    low: Any | None = None
    blocks: Any | None = None
    counts: Any | None = None
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    """Block-coded: steps of whole blocks as (first block, end block, first change, end change)."""
    starts: Any | None = None
    """Block-coded, on a CUDA device: each block's first change (the exclusive cumulative sum of ``counts``,
    int64), made in `prepare` (:func:`ready_to_apply`) so the Triton apply launches no kernel of its own for it
    inside the pause; None: the apply makes it."""

    @property
    def nbytes(self) -> int:
        """Bytes this change holds on its device."""
        parts = (self.operands, self.positions, self.low, self.blocks, self.counts, self.starts)
        return sum(int(p.numel()) * p.element_size() for p in parts if p is not None)


def ready_to_apply(staged: Iterable[StagedChange]) -> None:
    """What the apply kernel of a CUDA tensor would compute first, computed now, off the pause: the blocks'
    first changes of block-coded changes (``StagedChange.starts``; 8 bytes a block with changes)."""
    from weightsync.client.staged_triton import block_starts  # imports torch, not triton

    for s in staged:
        if s.counts is not None and s.starts is None and s.counts.device.type == "cuda":
            s.starts = block_starts(s.counts)


def stage_change(change: Any, device: Any, *, elements: int) -> StagedChange:
    """`change` (a codec Change of a tensor of `elements` elements) moved to `device`, compactly."""
    return stage_changes([(change, elements)], device)[0]


def stage_changes(changes: Sequence[tuple[Any, int]], device: Any) -> list[StagedChange]:
    """Each (codec Change, its tensor's elements) coded compactly (:func:`code_change`) and moved to `device`
    in one host-to-device copy: the staged arrays are views of one buffer there."""
    coded = [code_change(change, elements) for change, elements in changes]
    arrays = [getattr(c, f) for c in coded for f in _STAGED_FIELDS if getattr(c, f) is not None]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += aligned(a.nbytes)
    host = staging_buffer(total, device)
    places = {}  # id of a coded array -> its copy in `host`
    for a, off in zip(arrays, offsets, strict=True):
        host[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
        places[id(a)] = host[off : off + a.nbytes].view(a.dtype)

    def placed(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else places[id(a)]

    laid = [StagedChange(c.add, spans=c.spans, **{f: placed(getattr(c, f)) for f in _STAGED_FIELDS}) for c in coded]
    return move_staged(laid, host, device)


_STAGED_FIELDS = ("operands", "positions", "low", "blocks", "counts")


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to 8: staged arrays start at 8-byte aligned offsets of their buffer, so every
    view of them is of an aligned address."""
    return -(-nbytes // 8) * 8


def staging_buffer(nbytes: int, device: Any) -> np.ndarray:
    """A host buffer (uint8) of `nbytes` for staged arrays bound for `device` in one copy (:func:`move_staged`).

    For a CUDA device it is page-locked memory from torch's caching host allocator: the copy to the device
    runs at the link's speed (a pageable copy goes through the driver's bounce buffers), and once the
    update's arrays are gone the next update gets the same pages back, mapped and locked already, instead
    of faulting in fresh ones (on the 2-core VM the faults of a 60 MB staging buffer cost ~27 ms of CPU
    against ~14 ms for the pass that fills it). The allocator rounds a block up to a power of two and keeps
    it: up to twice the largest update's staging stays locked in the subscriber's process. Any other
    device gets plain memory (there the staged arrays are the buffer's own views, nothing is copied).
    """
    torch = torch_module()
    if str(device).split(":")[0] == "cuda" and torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return np.empty(nbytes, dtype=np.uint8)


def move_staged(laid: list[StagedChange], host: np.ndarray, device: Any) -> list[StagedChange]:
    """Host StagedChanges whose arrays are views of the one buffer `host` (uint8), moved to `device` in one
    host-to-device copy: the moved arrays are views of one buffer there, at the same offsets."""
    torch = torch_module()
    moved = torch.from_numpy(host).to(device)
    base = host.__array_interface__["data"][0]

    def view(a: np.ndarray) -> Any:
        dtype = torch.from_numpy(a[:0]).dtype
        if not a.nbytes:  # an empty slice has no stride to view through
            return torch.empty(0, dtype=dtype, device=moved.device)
        off = a.__array_interface__["data"][0] - base
        if off < 0 or off + a.nbytes > host.nbytes or not a.flags.c_contiguous:
            raise ValueError("a staged array is not a contiguous view of the staging buffer")
        return moved[off : off + a.nbytes].view(dtype)

    out = []
    for c in laid:
        fields = {f: (None if getattr(c, f) is None else view(getattr(c, f))) for f in _STAGED_FIELDS}
        out.append(StagedChange(c.add, spans=c.spans, **fields))
    return out


class HostOps(Sequence["Change"]):
    """The one decoded change of a tensor whose update was staged straight from its frames: made from the
    staged form's host copy only when something asks for it (an apply into host tensors, an undo on
    another device, an engine's own use); the host copy holds ~4 bytes a change, the decoded ~10."""

    def __init__(self, staged: StagedChange) -> None:
        self.staged = staged
        self._change: Any = None

    @property
    def elements(self) -> int:
        """The changed elements, without decoding them."""
        return len(self.staged.operands)

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(1))]
        if i not in (0, -1):
            raise IndexError(i)
        if self._change is None:
            self._change = unstage(self.staged)
        return self._change


def unstage(staged: StagedChange) -> Any:
    """The codec Change a host StagedChange (numpy arrays) stands for: positions expanded back to int64."""
    from weightsync.codec.values import Change

    if staged.positions is not None:
        positions = staged.positions.astype(np.int64)
    else:
        assert staged.low is not None and staged.blocks is not None and staged.counts is not None
        positions = np.repeat(staged.blocks.astype(np.int64) << BLOCK_BITS, staged.counts)
        positions += staged.low.view(np.uint16)
    return Change(staged.add, positions, staged.operands)


def index_dtype(elements: int) -> type[np.signedinteger[Any]]:
    """The integer type of a tensor's staged positions and block ids: int32, int64 from 2^31 elements on."""
    return np.int64 if elements >= 1 << 31 else np.int32


def block_coded(blocks: int, changes: int) -> bool:
    """Whether `changes` in `blocks` blocks of 2^BLOCK_BITS elements are staged block-coded (2 bytes a change and
    8 a block) rather than as int32 positions: when that is smaller, not with few changes per block."""
    return 8 * blocks < 2 * changes


def apply_spans(starts: np.ndarray, changes: int) -> list[tuple[int, int, int, int]]:
    """A block-coded change's apply steps: whole blocks, about APPLY_CHUNK changes each (one block may exceed
    it), as (first block, end block, first change, end change); `starts` is each block's first change."""
    spans = []
    b = 0
    while b < len(starts):
        e = max(int(np.searchsorted(starts, starts[b] + APPLY_CHUNK, side="right")), b + 1)
        spans.append((b, e, int(starts[b]), int(starts[e]) if e < len(starts) else changes))
        b = e
    return spans


def code_change(change: Any, elements: int) -> StagedChange:
    """`change` as a :class:`StagedChange` of host (numpy) arrays: block-coded positions where that is smaller."""
    pos: np.ndarray = change.positions
    operands = np.ascontiguousarray(change.operands)
    index = index_dtype(elements)
    if len(pos) == 0:
        return StagedChange(change.add, operands, positions=pos.astype(index))
    # Positions ascend: each block's first change is found by a binary search per block in the
    # range, not by passes over the positions (a tensor has at most ~elements / 2^16 blocks).
    first, last = int(pos[0]) >> BLOCK_BITS, int(pos[-1]) >> BLOCK_BITS
    bounds = np.searchsorted(pos, np.arange(first, last + 2, dtype=np.int64) << BLOCK_BITS)
    has = np.flatnonzero(bounds[1:] != bounds[:-1])
    if not block_coded(len(has), len(pos)):  # int32 positions are smaller: few changes per block
        return StagedChange(change.add, operands, positions=pos.astype(index))
    starts = bounds[has]
    counts = bounds[has + 1] - starts
    low = pos.astype(np.uint16).view(np.int16)  # the low BLOCK_BITS (= 16) bits: the cast keeps them
    spans = apply_spans(starts, len(pos))
    return StagedChange(
        change.add,
        operands,
        low=low,
        blocks=(has + first).astype(index),
        counts=counts.astype(np.int64),
        spans=spans,
    )


def apply_change_host(t: torch.Tensor, change: Any, *, track: bool = False, inverse: bool = False) -> tuple[int, ...]:
    """Apply a codec `Change` in place to a CPU tensor through a numpy view, APPLY_CHUNK positions at a time.

    numpy's fancy indexing runs on the calling thread at a few ns per element, where torch's
    index ops go through its intra-op pool and stall whenever another thread holds a core
    (measured: 3 vs 86 ns per element on a busy 2-core box). With `track`, each changed
    element is read back after its write and the move of the tensor's checksum lanes
    (FORMAT §10; ``codec.checksum.change_lanes``) is returned, so a result is checked from its
    verified base without reading the tensor again; else (). `inverse` undoes `change`.
    """
    from weightsync.codec.checksum import MASK, change_lanes, lanes_of

    view = int_view(t).numpy()
    width = t.element_size()
    lanes = [0] * lanes_of(width)
    positions, operands = change.positions, change.operands
    for lo in range(0, len(positions), APPLY_CHUNK):
        pos, ops = positions[lo : lo + APPLY_CHUNK], operands[lo : lo + APPLY_CHUNK]
        old = view[pos]
        view[pos] = (old - ops if inverse else old + ops) if change.add else old ^ ops  # wraps
        if track:
            moved = change_lanes(old, view[pos], pos, width)
            lanes = [(a + b) & MASK for a, b in zip(lanes, moved, strict=True)]
    return tuple(lanes) if track else ()


def apply_staged(t: torch.Tensor, staged: StagedChange, *, track: bool = False, inverse: bool = False) -> Any:
    """Apply `staged` in place to `t` (contiguous, on the change's device) with index ops there.

    With `track`, each changed element is read back after its write and the move of the
    tensor's checksum lanes is returned as an int64 tensor on the device, (lanes,) or (rows, lanes)
    whose rows add up to it (``devsum.change_lanes``, the Triton kernel's per-program moves; read it
    with ``devsum.lanes_to_ints``), else None. `inverse`
    undoes `staged`. `apply` changes host tensors with :func:`apply_change_host` instead
    (numpy on the calling thread: torch's index ops stall on a busy host).
    """
    if t.is_cuda and _triton_applies(t.device, t.element_size(), staged.positions is None, staged.add, inverse, track):
        from weightsync.client import staged_triton
        from weightsync.codec.checksum import lanes_of

        lanes = lanes_of(t.element_size())
        return staged_triton.apply(
            int_view(t), staged, track=track, inverse=inverse, block_bits=BLOCK_BITS, lanes=lanes
        )
    return _apply_staged_torch(t, staged, track=track, inverse=inverse)


def _triton_applies(device: Any, width: int, blocked: bool, add: bool, inverse: bool, track: bool) -> bool:
    """Whether client/staged_triton.py's kernel runs on `device` and does what the torch path does (same
    bytes, same checksum moves) for changes of this kind: checked on a test change the first time a kind
    is met on a device (each kind is its own compiled kernel); a failure is logged and torch kept."""
    from weightsync import devsum_triton

    kind = (width, blocked, add, add and inverse, track)
    key = ("apply", devsum_triton.device_key(device), *kind)
    return devsum_triton.checked_once(key, lambda: _check_triton_apply(device, *kind))


def warm_device_kernels(device: Any, kinds: Iterable[tuple[int, bool, bool]], *, widths: Iterable[int] = ()) -> None:
    """Compile and check, before any pause, the kernels `apply` runs on a CUDA `device` for changes of these
    kinds (element width, block-coded, add), with and without tracking (client/staged_triton.py), and the
    checksum's for tensors of these element widths (devsum_triton.py). A first compile takes seconds (5.8 s
    for a bf16 model on the H100 box): `prepare` calls this, off the pause. Nothing on other devices."""
    from weightsync import devsum

    torch = torch_module()
    if torch.device(device).type != "cuda":
        return
    for width, blocked, add in set(kinds):
        for track in (True, False):
            _triton_applies(device, width, blocked, add, False, track)
    for width in set(widths):
        devsum.warm(device, width)


def _check_triton_apply(device: Any, width: int, blocked: bool, add: bool, inverse: bool, track: bool) -> bool:
    from weightsync import devsum, devsum_triton
    from weightsync.client import staged_triton
    from weightsync.codec.checksum import lanes_of
    from weightsync.codec.values import Change

    if not devsum_triton.available():
        return False
    torch = torch_module()
    rng = np.random.default_rng(5)
    signed = np.dtype(f"<i{width}")
    # Several changes per block (block-coded) over a partial last block, or a few over many blocks (int32).
    n, density = (3 * (1 << BLOCK_BITS) + 5, 0.05) if blocked else (8 << BLOCK_BITS, 2e-5)
    positions = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    operands = rng.integers(-(1 << (8 * width - 1)), 1 << (8 * width - 1), len(positions), dtype=signed)
    base = torch.from_numpy(rng.integers(0, 256, n * width, dtype=np.uint8).view(signed)).to(device)
    try:
        staged = stage_change(Change(add, positions, operands), device, elements=n)
        if (staged.positions is None) != blocked:
            raise AssertionError("the test change is not of the kind checked")  # a staging rule changed
        a, b = base.clone(), base.clone()
        want = _apply_staged_torch(a, staged, track=track, inverse=inverse)

        def triton(view: Any) -> Any:
            return staged_triton.apply(
                view, staged, track=track, inverse=inverse, block_bits=BLOCK_BITS, lanes=lanes_of(width)
            )

        got = triton(b)
        same_lanes = not track or devsum.lanes_to_ints(want) == devsum.lanes_to_ints(got)
        if staged.counts is not None and staged.starts is None:  # block-coded: again with starts made ahead
            c = base.clone()
            staged.starts = staged_triton.block_starts(staged.counts)
            again = triton(c)
            same_lanes = same_lanes and torch.equal(a, c)
            same_lanes = same_lanes and (not track or devsum.lanes_to_ints(want) == devsum.lanes_to_ints(again))
        if not torch.equal(a, b) or not same_lanes:
            log.warning("the Triton apply kernel disagrees with torch on %s: using torch", device)
            return False
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile or launch here: torch serves
        log.warning("the Triton apply kernel does not run on %s (%s): using torch", device, exc)
        return False
    return True


def _apply_staged_torch(t: torch.Tensor, staged: StagedChange, *, track: bool, inverse: bool) -> Any:
    """:func:`apply_staged` with torch index ops (the reference for client/staged_triton.py)."""
    torch = torch_module()
    view = int_view(t)
    moved: list[Any] = []

    def apply(pos: Any, operands: Any) -> None:
        cur = view.index_select(0, pos)
        view.index_put_((pos,), (cur - operands if inverse else cur + operands) if staged.add else cur ^ operands)
        if track:
            from weightsync import devsum  # imports torch: only where a device tensor is tracked

            moved.append(devsum.change_lanes(cur, view.index_select(0, pos), pos))

    if staged.positions is not None:
        for lo in range(0, int(staged.positions.numel()), APPLY_CHUNK):
            apply(staged.positions[lo : lo + APPLY_CHUNK], staged.operands[lo : lo + APPLY_CHUNK])
    else:
        assert staged.low is not None and staged.blocks is not None and staged.counts is not None
        for b0, b1, c0, c1 in staged.spans:
            first = torch.repeat_interleave(
                staged.blocks[b0:b1] << BLOCK_BITS, staged.counts[b0:b1], output_size=c1 - c0
            )
            low = staged.low[c0:c1].to(first.dtype) & ((1 << BLOCK_BITS) - 1)
            apply(first + low, staged.operands[c0:c1])
    if not track:
        return None
    return torch.stack(moved).sum(dim=0) if moved else None
