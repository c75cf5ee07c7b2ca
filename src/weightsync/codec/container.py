"""The delta container file and offline diff/patch (docs/FORMAT.md §6).

A container holds one manifest and the frames it references, so a delta can be
shipped as a single file (like bsdiff for checkpoints). The manifest may be of
either format version (FORMAT §5.2, §5.3): ``diff`` writes what its encoder
writes (v2 by default), ``patch`` reads both. ``patch`` writes its output under
a temporary name and renames it into place only after every checksum has
passed: on any error nothing appears at OUT.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

from weightsync.codec.checkpoint import Checkpoint
from weightsync.codec.encoder import Decoder, Encoder
from weightsync.codec.manifest import MAX_MANIFEST, FrameRef, Manifest
from weightsync.errors import BadMagic, CorruptData, LimitExceeded, TruncatedInput, UnsupportedVersion

MAGIC = b"WSYNCDLT"
VERSION = 1
# FORMAT §6.1: magic, version, flags, reserved, manifest length, xxh3-64 of the stored manifest.
_HEADER = struct.Struct("<8sHHIQQ")
HEADER_SIZE = _HEADER.size  # 32


@dataclass
class DiffStats:
    """What a diff produced: raw bytes of NEW, bytes written, frames by kind."""

    raw_bytes: int
    delta_bytes: int
    frames: int
    delta_frames: int


def write_container(encoded_manifest: Manifest, frames: list[bytes], out: BinaryIO) -> int:
    """Write manifest + frames to the binary file object `out`; returns bytes written."""
    offsets = []
    pos = 0
    for fr in frames:
        offsets.append(pos)
        pos += len(fr)
    body = encoded_manifest.encode()
    out.write(_HEADER.pack(MAGIC, VERSION, 0, 0, len(body), xxhash.xxh3_64_intdigest(body)))
    out.write(body)
    for fr in frames:
        out.write(fr)
    return HEADER_SIZE + len(body) + pos


def read_container(data: memoryview | bytes) -> tuple[Manifest, memoryview]:
    """Validate a container; return its manifest and the frames area (refs are offsets into it)."""
    view = memoryview(data)
    if len(view) < HEADER_SIZE:
        if len(view) >= 8 and bytes(view[:8]) != MAGIC:
            raise BadMagic("not a weightsync delta file")
        raise TruncatedInput("delta file is shorter than its header")
    magic, version, flags, reserved, mlen, check = _HEADER.unpack(view[:HEADER_SIZE])
    if magic != MAGIC:
        raise BadMagic("not a weightsync delta file")
    if version != VERSION:
        raise UnsupportedVersion(f"delta file format version {version} (this reader knows {VERSION})")
    if flags or reserved:
        raise UnsupportedVersion(f"unknown delta file flags 0x{flags:04x}")
    if mlen > MAX_MANIFEST:
        raise LimitExceeded(f"delta file declares a {mlen}-byte manifest")
    if len(view) < HEADER_SIZE + mlen:
        raise TruncatedInput("delta file ends inside its manifest")
    body = view[HEADER_SIZE : HEADER_SIZE + mlen]
    if xxhash.xxh3_64_intdigest(body) != check:
        raise CorruptData("delta file manifest checksum mismatch")
    manifest = Manifest.decode(body)
    area = view[HEADER_SIZE + mlen :]
    for ref in manifest.frames:
        if ref.object is not None:
            raise CorruptData("delta file frame refers to a store object")
        if ref.offset + ref.length > len(area):
            raise TruncatedInput("delta file ends before its last frame")
    return manifest, area


def _replace_atomically(tmp: Path, final: Path) -> None:
    if final.is_dir() and not final.is_symlink():
        if any(final.iterdir()):
            raise FileExistsError(f"{final} is a non-empty directory")
        final.rmdir()
    os.replace(tmp, final)


def diff(
    base: str | os.PathLike[str],
    new: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    encoder: Encoder | None = None,
) -> DiffStats:
    """Write the delta that turns BASE into NEW (files or directories) to OUT, atomically."""
    enc = encoder or Encoder()
    base_ck, new_ck = Checkpoint.open(base), Checkpoint.open(new)
    if base_ck.single_file != new_ck.single_file:
        raise ValueError("BASE and NEW must both be files or both be directories")
    encoded = enc.encode(new_ck, base_ck)
    offsets: list[int] = []
    pos = 0
    for fr in encoded.frames:
        offsets.append(pos)
        pos += len(fr.data)
    manifest = encoded.with_locations(lambda i, fr: (None, offsets[i]))
    out = Path(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent or ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            written = write_container(manifest, [fr.data for fr in encoded.frames], fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return DiffStats(new_ck.raw_bytes, written, len(encoded.frames), sum(fr.delta for fr in encoded.frames))


def patch(
    base: str | os.PathLike[str],
    delta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    decoder: Decoder | None = None,
) -> Manifest:
    """Apply DELTA to BASE and write the result to OUT, byte-identical to the diffed NEW.

    Raises BaseMismatch for a wrong base and a FormatError subclass for a damaged
    delta; in every failure case OUT is left as it was.
    """
    dec = decoder or Decoder()
    out = Path(out)
    delta_path = Path(delta)
    size = delta_path.stat().st_size
    data = np.memmap(delta_path, dtype=np.uint8, mode="r") if size else np.zeros(0, dtype=np.uint8)
    manifest, area = read_container(data.data)
    base_ck = Checkpoint.open(base)

    def read_frame(ref: FrameRef) -> memoryview:
        return area[ref.offset : ref.offset + ref.length]

    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    if manifest.single_file:
        if base_ck.single_file is False:
            raise ValueError("this delta is for a single file, but BASE is a directory")
        fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            _decode_to(dec, manifest, read_frame, base_ck, [tmp])
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return manifest
    if base_ck.single_file:
        raise ValueError("this delta is for a directory, but BASE is a file")
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=parent))
    try:
        targets = []
        for f in manifest.files:
            target = tmp_dir / f.path
            target.parent.mkdir(parents=True, exist_ok=True)
            targets.append(target)
        _decode_to(dec, manifest, read_frame, base_ck, targets)
        _replace_atomically(tmp_dir, out)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return manifest


def _decode_to(
    dec: Decoder, manifest: Manifest, read_frame: Callable[[FrameRef], memoryview], base: Checkpoint, paths: list[Path]
) -> None:
    """Decode into files at `paths` (created here, sized, fsynced)."""
    outputs = []
    for f, path in zip(manifest.files, paths, strict=True):
        with open(path, "wb") as fh:
            fh.truncate(f.size)
        outputs.append(np.memmap(path, dtype=np.uint8, mode="r+") if f.size else np.zeros(0, dtype=np.uint8))
    dec.decode(manifest, read_frame, outputs, base, verify_segments=True)
    for out, path in zip(outputs, paths, strict=True):
        if isinstance(out, np.memmap):
            out.flush()
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
