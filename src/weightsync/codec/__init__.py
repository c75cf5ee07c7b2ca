"""The weightsync codec: exact, compressed XOR deltas of tensor checkpoints (docs/FORMAT.md).

Pure functions over bytes and numpy arrays; imports nothing of store, catalog
or torch. Reusable objects (:class:`Encoder`, :class:`Decoder`) plus one-shot
functions (:func:`diff`, :func:`patch`, :func:`encode_key`, :func:`encode_delta`,
:func:`decode_frame`), and the FORMAT v2 tensor checksum (:func:`tensor_sum`).
"""

from weightsync.codec.checkpoint import Checkpoint, CheckpointFile, FileLayout, Segment
from weightsync.codec.checksum import TensorSum, tensor_sum
from weightsync.codec.container import DiffStats, diff, patch, read_container, write_container
from weightsync.codec.dtypes import DType, by_code, by_name
from weightsync.codec.encoder import Decoder, Encoded, EncodedFrame, Encoder
from weightsync.codec.frame import apply_frame, decode_frame, encode_delta, encode_key, parse_header, xxh3_128
from weightsync.codec.manifest import FileEntry, FrameRef, Manifest, Piece, SegmentEntry

__all__ = [
    "Checkpoint",
    "CheckpointFile",
    "DType",
    "Decoder",
    "DiffStats",
    "Encoded",
    "EncodedFrame",
    "Encoder",
    "FileEntry",
    "FileLayout",
    "FrameRef",
    "Manifest",
    "Piece",
    "Segment",
    "SegmentEntry",
    "apply_frame",
    "by_code",
    "by_name",
    "decode_frame",
    "diff",
    "encode_delta",
    "encode_key",
    "parse_header",
    "patch",
    "read_container",
    "write_container",
    "xxh3_128",
    "TensorSum",
    "tensor_sum",
]
