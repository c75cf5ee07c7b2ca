"""Weight quantizers used to export inference-engine formats: FP8 E4M3 (per tensor), MXFP4, NVFP4.

All take a 2-D float tensor (any float dtype; math in fp32) and return plain tensors ready for safetensors.

FP4 E2M1 (both MXFP4 and NVFP4): 1 sign, 2 exponent, 1 mantissa bit; the 8 magnitudes are
``0, 0.5, 1, 1.5, 2, 3, 4, 6`` for codes 0..7 (code = the 3 low bits), sign in bit 3. Rounding is to
nearest, ties to the even code; values beyond 6 saturate. A zero magnitude is stored as +0 (code 0).
Two codes per byte: the element with the even index in the low nibble, the odd one in the high nibble
(the packing of gpt-oss and of ModelOpt).
"""

from __future__ import annotations

import torch

FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
_FP4_MIDPOINTS = (FP4_VALUES[1:] + FP4_VALUES[:-1]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5.0
FP4_MAX = 6.0
FP8_E4M3_MAX = 448.0
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16


def fp4_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest E2M1 value (ties to even code, saturating); return uint8 codes 0..15."""
    x = x.float()
    a = x.abs().clamp(max=FP4_MAX)
    lo = torch.searchsorted(_FP4_MIDPOINTS, a, right=False)  # on a tie: the smaller code
    hi = torch.searchsorted(_FP4_MIDPOINTS, a, right=True)  # on a tie: the larger code
    mag = torch.where((lo != hi) & (hi % 2 == 0), hi, lo).to(torch.uint8)
    sign = ((x < 0) & (mag != 0)).to(torch.uint8) << 3
    return mag | sign


def fp4_e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp4_e2m1_codes`: uint8 codes 0..15 -> fp32 values."""
    c = codes.to(torch.int64)
    v = FP4_VALUES[c & 7]
    return torch.where((c & 8) != 0, -v, v)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] uint8 codes -> [..., n] bytes, even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError("last dimension must be even to pack fp4 pairs")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---------------------------------------------------------------------------------------------------
# FP8 E4M3, one fp32 scale per tensor (dequant: w ~= q.float() * scale)


def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    amax = w.abs().max()
    scale = (amax / FP8_E4M3_MAX) if amax > 0 else torch.tensor(1.0)
    q = (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(()).to(torch.float32)


def dequantize_fp8_per_tensor(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()


# ---------------------------------------------------------------------------------------------------
# MXFP4 (OCP microscaling; gpt-oss checkpoint layout)
#   blocks: uint8 [..., K/32, 16]  -- 32 fp4 codes per block along the last dim, two per byte
#   scales: uint8 [..., K/32]      -- E8M0: the block's scale is 2**(s - 127)
# The shared exponent is the smallest power of two with max|block| / 2**e <= 6 (no clipping of the block
# maximum); e is clamped to the E8M0 range [-127, 127]; an all-zero block gets e = -127 (byte 0).


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"last dimension {k} is not a multiple of {MXFP4_BLOCK}")
    x = w.float().reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = x.abs().amax(dim=-1)
    # exact power-of-two search on float32: start from ceil(log2(amax/6)) and fix up rounding error
    e = torch.ceil(torch.log2(amax / FP4_MAX).clamp(min=-127.0))
    e = torch.where(torch.ldexp(torch.full_like(amax, FP4_MAX), e) < amax, e + 1, e)
    e = torch.where(torch.ldexp(torch.full_like(amax, FP4_MAX), e - 1) >= amax, e - 1, e)
    e = torch.where(amax > 0, e, torch.full_like(e, -127.0)).clamp(-127.0, 127.0)
    scaled = torch.ldexp(x, -e.unsqueeze(-1))
    codes = fp4_e2m1_codes(scaled)
    blocks = pack_nibbles(codes)  # [..., K/32, 16]
    scales = (e + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    vals = fp4_e2m1_values(unpack_nibbles(blocks))  # [..., K/32, 32]
    e = scales.to(torch.float32) - 127.0
    out = torch.ldexp(vals, e.unsqueeze(-1))
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK)


# ---------------------------------------------------------------------------------------------------
# NVFP4 (NVIDIA ModelOpt checkpoint layout)
#   weight:         uint8 [N, K/2]          -- fp4 codes, two per byte
#   weight_scale:   float8_e4m3fn [N, K/16] -- per block of 16 along K
#   weight_scale_2: float32 scalar          -- global: amax(w) / (6 * 448)
# dequant: w ~= fp4 * weight_scale.float() * weight_scale_2


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if w.dim() != 2 or w.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs a 2-D weight with K % {NVFP4_BLOCK} == 0, got {tuple(w.shape)}")
    n, k = w.shape
    x = w.float().reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = x.abs().max()
    scale_2 = (amax / (FP4_MAX * FP8_E4M3_MAX)) if amax > 0 else torch.tensor(1.0)
    block_amax = x.abs().amax(dim=-1)
    block_scale = (block_amax / (FP4_MAX * scale_2)).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    denom = block_scale.float() * scale_2
    scaled = torch.where(denom.unsqueeze(-1) > 0, x / denom.unsqueeze(-1), torch.zeros_like(x))
    codes = fp4_e2m1_codes(scaled).reshape(n, k)
    return pack_nibbles(codes).contiguous(), block_scale.contiguous(), scale_2.reshape(()).to(torch.float32)


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    n = weight.shape[0]
    vals = fp4_e2m1_values(unpack_nibbles(weight)).reshape(n, -1, NVFP4_BLOCK)
    out = vals * weight_scale.float().unsqueeze(-1) * weight_scale_2.float()
    return out.reshape(n, -1)
