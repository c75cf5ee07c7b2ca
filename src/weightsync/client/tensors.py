"""torch tensors ⇄ safetensors bytes, and in-place updates of tensors on any device.

torch is imported lazily, only by the functions here that need it: the rest of
the SDK works without it. In-place updates view a tensor as the signed integer
type of its element width and change elements with index ops on the tensor's
own device (two's-complement addition wraps, so zigzag differences apply
exactly); only the small (positions, operands) arrays cross to the device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from weightsync import errors
from weightsync.codec import safetensors
from weightsync.codec.frame import xxh3_128

if TYPE_CHECKING:  # pragma: no cover
    import torch

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
    torch = torch_module()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # xxh3 and serialization run on the host: device tensors are copied there
    t = t.contiguous()
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


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
    bf16 and fp8 bytes are taken through a uint8 view: no conversion.
    """
    torch_module()
    specs = []
    datas = []
    for name, t in state_dict.items():
        if not isinstance(name, str):
            raise TypeError("state_dict keys must be strings")
        data = raw_bytes(t)
        specs.append((name, dtype_name(t.dtype), tuple(int(d) for d in t.shape), len(data)))
        datas.append(data)
    header = safetensors.serialize_header(specs, dict(metadata) if metadata is not None else {"format": "pt"})
    out = np.empty(len(header) + sum(len(d) for d in datas), dtype=np.uint8)
    out[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    pos = len(header)
    for d in datas:
        out[pos : pos + len(d)] = d
        pos += len(d)
    return out


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
