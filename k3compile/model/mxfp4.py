"""MXFP4 (OCP Microscaling Formats v1.0) utilities in plain PyTorch.

Format (K3-SPEC.md section 1): along the quantised dim (K, the last dim by default)
each block of ``BLOCK = 32`` consecutive elements shares one E8M0 scale byte ``s``
whose value is ``2**(s - 127)`` (``s == 255`` is NaN); every element is an FP4 E2M1
code (``E2M1_VALUES[code]``), two codes per byte, LOW NIBBLE FIRST: element ``2i``
sits in bits 0-3 and element ``2i+1`` in bits 4-7 of byte ``i``.

Storage: ``packed`` uint8 ``[..., K // 2]`` and ``scales`` uint8 ``[..., K // 32]``.
(torchao's ``float4_e2m1fn_x2`` / ``float8_e8m0fnu`` tensors hold the same bytes;
pass them here as ``t.view(torch.uint8)``.)

Quantisation rule (``quantize``), identical to torchao 0.18 ``to_mx(...,
torch.float4_e2m1fn_x2, 32)`` in its default ``ScaleCalculationMode.FLOOR`` mode
(the OCP "minimally supported" scale) except for the one torchao quirk noted below:

* the input is cast to fp32 first (exact for bf16/fp16/fp32 inputs);
* ``amax`` = max |x| of the block;
  ``shared_exp = floor(log2(amax)) - 2`` (2 = emax of E2M1, whose max is 6 = 1.5 * 2**2),
  where ``floor(log2(amax))`` is read from the fp32 exponent field (so an all-zero or
  fp32-subnormal block gets -127), clamped to [-127, 127]; scale byte ``s = shared_exp + 127``.
  An all-zero block therefore gets ``s = 0``.
* every element is ``x / 2**shared_exp`` rounded to the nearest E2M1 value, ties to
  even (even = mantissa bit 0), saturating at +-6 (with the FLOOR scale the scaled
  block max lies in [4, 8), so values in (5, 8) become 6). The sign is kept even when
  the magnitude rounds to 0, so negative values that round to zero, and -0.0, give
  code 8 (-0), exactly like torchao.
* NaN / Inf inputs are rejected with ``ValueError`` (torchao would produce a NaN
  scale byte 255 / garbage codes; there is no sensible MXFP4 weight for them).

The torchao quirk we do NOT copy: for blocks whose scale byte is 0 (``amax < 2**-124``,
i.e. tiny or all-zero blocks) torchao divides the elements by 2**-126 (it clamps the
fp32 scale to the smallest normal float as a Triton workaround) while still storing
byte 0, i.e. its codes decode to half the intended value. We divide by the true
2**-127 so that ``dequantize`` (value = code * 2**(s - 127), as in the spec and in
hardware) reproduces the values. Scale bytes are identical in all cases; packed
bytes are identical in all blocks with ``s != 0`` and in all-zero blocks.

``dequantize`` is exact: every code value times a power of two is representable in
fp32 (including the fp32-subnormal 2**-127 .. 2**-128 cases) and in bf16; an fp16
result over- or underflows for scales outside fp16's range.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "E2M1_VALUES",
    "EMAX_E2M1",
    "E8M0_BIAS",
    "E8M0_NAN",
    "quantize",
    "dequantize",
    "pack_fp4",
    "unpack_fp4",
    "e8m0_to_float32",
]

#: Elements per shared scale (OCP MX block size).
BLOCK = 32

#: The 16 FP4 E2M1 code values; code 8 is -0.0.
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)

#: Exponent of the largest power of two representable in E2M1 (4 = 2**2).
EMAX_E2M1 = 2
#: E8M0 exponent bias and NaN encoding.
E8M0_BIAS = 127
E8M0_NAN = 255

# Round-to-nearest-even boundaries on the E2M1 magnitude grid
# 0, 0.5, 1, 1.5, 2, 3, 4, 6. A tie goes to the code with an even mantissa bit
# (codes 0, 2, 4, 6), so the tie points 0.25, 1.25, 2.5, 5.0 round DOWN (strict >)
# and 0.75, 1.75, 3.5 round UP (>=).
_RNE_THRESHOLDS: tuple[tuple[float, bool], ...] = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def _is_real_tensor(t: Tensor) -> bool:
    """True for a concrete tensor whose values may be read (not meta/fake/traced)."""
    if t.device.type == "meta":
        return False
    try:
        if torch.compiler.is_compiling():
            return False
    except AttributeError:  # pragma: no cover - very old torch
        pass
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover
        return True
    return not isinstance(t, FakeTensor)


def _check_tensor(name: str, t: object) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_uint8(name: str, t: Tensor) -> None:
    if t.dtype != torch.uint8:
        hint = ""
        if t.element_size() == 1 and t.dtype != torch.int8:
            hint = " (reinterpret torchao fp4x2 / e8m0 tensors with .view(torch.uint8))"
        raise ValueError(f"{name} must have dtype torch.uint8, got {t.dtype}{hint}")


def _norm_dim(dim: int, ndim: int, fn: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{fn}: dim={dim} is out of range for a {ndim}-D tensor")
    return dim % ndim


# --------------------------------------------------------------------------- packing


def pack_fp4(codes: Tensor) -> Tensor:
    """Pack 4-bit codes uint8 ``[..., K]`` (values 0..15) into uint8 ``[..., K // 2]``.

    Low nibble first: ``packed[..., i] = codes[..., 2i] | codes[..., 2i+1] << 4``.
    """
    _check_tensor("codes", codes)
    _check_uint8("codes", codes)
    if codes.dim() == 0:
        raise ValueError("pack_fp4: codes must have at least one dim, got a 0-d tensor")
    if codes.shape[-1] % 2 != 0:
        raise ValueError(
            f"pack_fp4: the last dim of codes must be even, got shape {tuple(codes.shape)}"
        )
    if _is_real_tensor(codes) and codes.numel() > 0 and int(codes.max()) > 15:
        raise ValueError(f"pack_fp4: codes must be in [0, 15], got max {int(codes.max())}")
    return _pack_fp4(codes)


def _pack_fp4(codes: Tensor) -> Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Unpack uint8 ``[..., K // 2]`` into 4-bit codes uint8 ``[..., K]`` (low nibble first)."""
    _check_tensor("packed", packed)
    _check_uint8("packed", packed)
    if packed.dim() == 0:
        raise ValueError("unpack_fp4: packed must have at least one dim, got a 0-d tensor")
    return _unpack_fp4(packed)


def _unpack_fp4(packed: Tensor) -> Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# --------------------------------------------------------------------------- scales


def e8m0_to_float32(scales: Tensor) -> Tensor:
    """E8M0 scale bytes (uint8) -> fp32 ``2**(s - 127)`` exactly; byte 255 -> NaN.

    Built from the fp32 bit pattern (no pow), so it is exact and compile-friendly:
    s in 1..254 is the normal float with exponent field s, s == 0 is the subnormal
    2**-127 (bit pattern 0x00400000).
    """
    _check_tensor("scales", scales)
    _check_uint8("scales", scales)
    return _e8m0_to_float32(scales)


def _e8m0_to_float32(scales: Tensor) -> Tensor:
    s = scales.to(torch.int32)
    bits = torch.where(
        s == 0,
        torch.full_like(s, 0x00400000),
        torch.where(s == E8M0_NAN, torch.full_like(s, 0x7FC00000), s << 23),
    )
    return bits.view(torch.float32)


# --------------------------------------------------------------------------- quantize


def _round_to_e2m1(y: Tensor) -> Tensor:
    """fp32 (already divided by the block scale) -> E2M1 codes uint8, RNE, saturating."""
    a = y.abs()
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t, inclusive in _RNE_THRESHOLDS:
        mag += (a >= t if inclusive else a > t).to(torch.uint8)
    return mag | (torch.signbit(y).to(torch.uint8) << 3)


def quantize(w: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """Quantise ``w`` to MXFP4 along ``dim`` (default the last dim, K) in blocks of 32.

    Returns ``(packed, scales)``: uint8 ``[..., K // 2]`` (two E2M1 codes per byte,
    low nibble first) and uint8 ``[..., K // 32]`` (E8M0 bytes). With ``dim != -1`` the
    quantised dim of both outputs stays in position ``dim``. See the module docstring
    for the exact (torchao FLOOR / OCP) rounding rules.
    """
    _check_tensor("w", w)
    if not w.is_floating_point():
        raise ValueError(f"quantize: w must be a floating-point tensor, got dtype {w.dtype}")
    if w.dim() == 0:
        raise ValueError("quantize: w must have at least one dim, got a 0-d tensor")
    d = _norm_dim(dim, w.dim(), "quantize")
    moved = d != w.dim() - 1
    if moved:
        w = w.movedim(d, -1)
    K = w.shape[-1]
    if K % BLOCK != 0:
        raise ValueError(
            f"quantize: the quantised dim has K={K} elements, which is not a multiple "
            f"of the MXFP4 block size {BLOCK} (shape {tuple(w.shape)}, dim={dim})"
        )
    x = w.to(torch.float32)
    if _is_real_tensor(x) and x.numel() > 0 and not bool(torch.isfinite(x).all()):
        raise ValueError("quantize: w contains NaN or Inf, which MXFP4 weights cannot encode")

    xb = x.reshape(*x.shape[:-1], K // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    # floor(log2(amax)) from the fp32 exponent field (0 / subnormal -> -127).
    exp_field = (amax.view(torch.int32) >> 23) & 0xFF
    shared = (exp_field - E8M0_BIAS - EMAX_E2M1).clamp(-E8M0_BIAS, E8M0_BIAS)
    scale_bytes = (shared + E8M0_BIAS).to(torch.uint8).squeeze(-1)
    # 1 / 2**shared as an exact fp32 power of two (biased exponent 127 - shared,
    # 0 only for shared == 127 -> subnormal 2**-127).
    inv_biased = E8M0_BIAS - shared
    inv_bits = torch.where(inv_biased == 0, torch.full_like(inv_biased, 0x00400000), inv_biased << 23)
    y = xb * inv_bits.view(torch.float32)
    codes = _round_to_e2m1(y).reshape(x.shape)
    packed = _pack_fp4(codes)
    if moved:
        packed = packed.movedim(-1, d)
        scale_bytes = scale_bytes.movedim(-1, d)
    return packed.contiguous(), scale_bytes.contiguous()


# --------------------------------------------------------------------------- dequantize


def _check_packed_scales(packed: Tensor, scales: Tensor, fn: str,
                         pname: str = "packed", sname: str = "scales") -> None:
    _check_tensor(pname, packed)
    _check_tensor(sname, scales)
    _check_uint8(pname, packed)
    _check_uint8(sname, scales)
    if packed.dim() == 0:
        raise ValueError(f"{fn}: {pname} must have at least one dim, got a 0-d tensor")
    K = packed.shape[-1] * 2
    if K % BLOCK != 0:
        raise ValueError(
            f"{fn}: {pname} of shape {tuple(packed.shape)} holds K = 2*{packed.shape[-1]} = {K} "
            f"elements along the quantised dim, not a multiple of the block size {BLOCK}"
        )
    expected = (*packed.shape[:-1], K // BLOCK)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"{fn}: {sname} shape {tuple(scales.shape)} does not match {pname} shape "
            f"{tuple(packed.shape)}; expected {sname} shape {expected} ([..., K//32] for "
            f"{pname} [..., K//2] with K={K})"
        )


def dequantize(packed: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16,
               dim: int = -1) -> Tensor:
    """MXFP4 ``(packed [..., K//2], scales [..., K//32])`` -> ``[..., K]`` in ``dtype``.

    value = E2M1_VALUES[code] * 2**(s - 127) (s == 255 -> NaN), computed exactly in fp32
    and then cast to ``dtype``. ``dim`` names the quantised dim of both inputs.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dequantize: dtype must be a floating-point torch.dtype, got {dtype!r}")
    _check_tensor("packed", packed)
    _check_tensor("scales", scales)
    if packed.dim() == 0:
        raise ValueError("dequantize: packed must have at least one dim, got a 0-d tensor")
    d = _norm_dim(dim, packed.dim(), "dequantize")
    if scales.dim() != packed.dim():
        raise ValueError(
            f"dequantize: scales shape {tuple(scales.shape)} does not match packed shape "
            f"{tuple(packed.shape)} (different rank)"
        )
    moved = d != packed.dim() - 1
    if moved:
        packed = packed.movedim(d, -1)
        scales = scales.movedim(d, -1)
    _check_packed_scales(packed, scales, "dequantize")
    out = _dequantize(packed, scales, dtype)
    return out.movedim(-1, d) if moved else out


def _e2m1_values(codes: Tensor) -> Tensor:
    """fp32 values of E2M1 codes (0..15), computed elementwise: no device table, so nothing is
    allocated once and kept (a tensor made during a CUDA-graph-trees warm-up would live in the
    graph's private pool, which mode="reduce-overhead" refuses). Exponent e = bits 1-2, mantissa
    m = bit 0, sign = bit 3: e == 0 -> m / 2, else 2^(e-1) * (1 + m / 2)."""
    c = codes.to(torch.int32)
    m = (c & 1).to(torch.float32)
    e = (c >> 1) & 3
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).to(torch.float32)) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def _dequantize(packed: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """Unchecked dequantisation along the last dim."""
    codes = _unpack_fp4(packed)
    K = codes.shape[-1]
    vals = _e2m1_values(codes).reshape(*codes.shape[:-1], K // BLOCK, BLOCK)
    vals = vals * _e8m0_to_float32(scales).unsqueeze(-1)
    return vals.reshape(*codes.shape[:-1], K).to(dtype)
