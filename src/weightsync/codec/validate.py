"""What may be published: complete safetensors weights, never a broken or pickled checkpoint.

A publish ships its bytes to every replica, so a checkpoint is checked before
anything leaves the trainer (issue 12): every ``*.safetensors`` file must parse
completely (FORMAT §2: header bounds, dtype and shape against byte ranges,
tensors tiling the data region exactly; tensor bytes are not read), and the
checkpoint must hold safetensors weights. Pickle checkpoints (``*.bin``,
``*.pt``, ``*.pth``, ``*.ckpt``) are never published: alone they are refused,
next to safetensors weights they are left out with a warning. Other files
(configs, tokenizers) travel as they are.

The rules live in two functions: :func:`validate_for_publish` on a checkpoint
(the publisher: it has the bytes, so it names a broken file's defect, and it
leaves pickles out), and :func:`check_publishable` on file layouts alone, which
is what a manifest holds (the service runs it on the version it commits, so the
two sides agree by construction). Only publishing is strict: ``Checkpoint.open``,
``diff`` and ``patch`` carry any file exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.codec import safetensors
from weightsync.codec.checkpoint import Checkpoint, CheckpointFile, FileLayout, Segment, is_safetensors
from weightsync.codec.dtypes import U8
from weightsync.errors import InvalidCheckpoint, SafetensorsError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
"""File name endings of torch pickle checkpoints (compared case-insensitively)."""

_LISTED = 5
"""At most this many paths are named in one message; the rest are counted."""

_MIN_HEADER = 10
"""The shortest safetensors header: the 8-byte length and "{}"."""


@dataclass(frozen=True)
class Validated:
    """A checkpoint cleared for publishing: what to publish, what was left out of it, and why."""

    checkpoint: Checkpoint
    """The source's files less ``left_out`` (the source itself when nothing was left out)."""
    left_out: tuple[str, ...]
    """Pickle files found next to safetensors weights, not published."""
    warnings: tuple[str, ...]
    """One line per thing the caller should be told (empty, or the left-out pickles)."""


def is_pickle(path: str) -> bool:
    """Whether `path` names a torch pickle checkpoint (by its name)."""
    return path.lower().endswith(PICKLE_SUFFIXES)


def validate_for_publish(checkpoint: Checkpoint, *, source: str = "the checkpoint") -> Validated:
    """Check `checkpoint` before publishing it; InvalidCheckpoint (one line) if it must not be published.

    A ``*.safetensors`` file that does not parse completely is refused with its
    path and defect; pickles next to safetensors weights are left out (the
    warning lists them); what remains must pass :func:`check_publishable`.
    `source` names the checkpoint in messages about it as a whole (a path,
    "the state_dict"). Costs no I/O for valid files: their layouts were parsed
    when the checkpoint was opened.
    """
    broken = [f for f in checkpoint.files if is_safetensors(f.layout.path) and f.layout.segments[0].kind == "blob"]
    if broken:
        more = f" (and {len(broken) - 1} more invalid safetensors files)" if len(broken) > 1 else ""
        raise InvalidCheckpoint(_defect(broken[0]) + more)
    left_out = tuple(f.layout.path for f in checkpoint.files if is_pickle(f.layout.path))
    if left_out and any(is_safetensors(f.layout.path) for f in checkpoint.files):
        dropped = set(left_out)
        kept = [f for f in checkpoint.files if f.layout.path not in dropped]
        checkpoint = Checkpoint(kept, single_file=checkpoint.single_file)
    else:
        left_out = ()  # no weights beside them: check_publishable refuses the pickles and says why
    check_publishable([f.layout for f in checkpoint.files], single_file=checkpoint.single_file, source=source)
    if not left_out:
        return Validated(checkpoint, (), ())
    warning = f"left out pickle files (only safetensors weights are published; convert them): {_names(left_out)}"
    return Validated(checkpoint, left_out, (warning,))


def check_publishable(layouts: Sequence[FileLayout], *, single_file: bool = False, source: str = "the version") -> None:
    """The rules a version's files must meet, on their layouts alone (a manifest's ``FileEntry.layout``).

    InvalidCheckpoint unless: there is no pickle file; there is a ``*.safetensors``
    file; each such file is a header segment (U8, offset 0, at least 10 and at most
    8 + 100,000,000 bytes) followed only by tensor segments with distinct names, at
    most 1,000,000, whose lengths follow from dtype and shape within 64 bits and
    which tile the rest of the file (FORMAT §2); and one tensor at least exists.
    """
    pickles = [x.path for x in layouts if is_pickle(x.path)]
    weights = [x for x in layouts if is_safetensors(x.path)]
    if not weights:
        raise InvalidCheckpoint(_no_weights([x.path for x in layouts], pickles, single_file, source))
    if pickles:
        raise InvalidCheckpoint(f"{source}: pickle files are not published ({_names(pickles)}): {_CONVERT}")
    for layout in weights:
        try:
            _check_safetensors_segments(layout.segments, layout.size)
        except SafetensorsError as exc:
            raise InvalidCheckpoint(f"{layout.path}: {exc}") from None
    if not any(seg.kind == "tensor" for x in weights for seg in x.segments):
        raise InvalidCheckpoint(f"{source}: its safetensors files ({_names([x.path for x in weights])}) hold no tensor")


def _check_safetensors_segments(segments: Sequence[Segment], size: int) -> None:
    """A safetensors file's segments as the parser makes them (codec/checkpoint.py ``layout_of``)."""
    header = segments[0] if segments else None
    if (
        header is None
        or (header.kind, header.name, header.dtype, header.offset) != ("header", "", U8, 0)
        or header.shape != (header.length,)
        or not _MIN_HEADER <= header.length <= 8 + safetensors.MAX_HEADER
    ):
        raise SafetensorsError("does not start with a safetensors header segment")
    if len(segments) - 1 > safetensors.MAX_TENSORS:
        raise SafetensorsError(f"more than {safetensors.MAX_TENSORS} tensors")
    names: set[str] = set()
    cursor = header.length
    for seg in segments[1:]:
        if seg.kind != "tensor":
            raise SafetensorsError(f"a {seg.kind} segment at byte {seg.offset}, where only tensors may follow")
        if seg.name in names or seg.name == "__metadata__":
            raise SafetensorsError(f"tensor name {seg.name!r} repeated or reserved")
        names.add(seg.name)
        if safetensors.tensor_nbytes(seg.name, seg.dtype, seg.shape) != seg.length or seg.offset != cursor:
            raise SafetensorsError(f"tensor {seg.name!r} at byte {seg.offset} does not follow its dtype and shape")
        cursor += seg.length
    if cursor != size:
        raise SafetensorsError(f"the tensors end at byte {cursor} but the file has {size} bytes")


def _defect(f: CheckpointFile) -> str:
    """'<path>: <defect>' of a ``*.safetensors`` file that did not parse (parsed again for the reason)."""
    try:
        safetensors.parse_file(f.data)
    except SafetensorsError as exc:
        return f"{f.layout.path}: {exc}"
    return f"{f.layout.path}: the file changed while it was being read"


_CONVERT = "convert to safetensors (e.g. safetensors.torch.save_file(torch.load(path), 'model.safetensors'))"


def _no_weights(paths: list[str], pickles: list[str], single_file: bool, source: str) -> str:
    """Why a version without safetensors weights is refused, and what to do instead."""
    if single_file:
        if pickles:
            return f"{source}: a pickle checkpoint, which weightsync does not publish: {_CONVERT}"
        return f"{source}: not a safetensors file (publish *.safetensors weights; other files travel next to them)"
    if pickles:
        return f"{source}: only pickle weights ({_names(pickles)}), which weightsync does not publish: {_CONVERT}"
    if not paths:
        return f"{source}: no files to publish"
    return f"{source}: no safetensors weights (*.safetensors) among its files: {_names(paths)}"


def _names(paths: Sequence[str]) -> str:
    """Up to _LISTED paths, comma-separated, then how many more."""
    more = f" and {len(paths) - _LISTED} more" if len(paths) > _LISTED else ""
    return ", ".join(paths[:_LISTED]) + more
