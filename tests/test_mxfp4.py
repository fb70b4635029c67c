"""Tests for k3compile.model.mxfp4 (OCP MX v1.0 MXFP4: E2M1 codes + E8M0 scale per 32)."""
from __future__ import annotations

import math

import pytest
import torch

from k3compile.model.mxfp4 import (
    BLOCK,
    E2M1_VALUES,
    dequantize,
    e8m0_to_float32,
    pack_fp4,
    quantize,
    unpack_fp4,
)

MAG = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _block(vals, fill=0.0):
    vals = list(vals)
    return torch.tensor(vals + [fill] * (BLOCK - len(vals)), dtype=torch.float32)


# --------------------------------------------------------------------------- independent reference


def _ref_quantize(w: torch.Tensor):
    """Brute-force MXFP4 quantiser, written independently of the implementation.

    Scale: floor(log2(amax)) via frexp (in float64), minus 2, clamped to [-127, 127];
    codes: the nearest of all 8 magnitudes (exact float64 distances), ties to the even
    code, sign bit from the sign of x (so -0 and small negatives give code 8).
    Returns (codes uint8 [..., K], scale bytes uint8 [..., K//32]).
    """
    x = w.to(torch.float64)
    xb = x.reshape(*x.shape[:-1], -1, BLOCK)
    amax = xb.abs().amax(-1)
    _, ex = torch.frexp(amax)  # amax = m * 2**ex, m in [0.5, 1)
    floor_log2 = torch.where(amax > 0, ex.to(torch.int64) - 1, torch.full_like(ex, -1000, dtype=torch.int64))
    shared = (floor_log2 - 2).clamp(-127, 127)
    scaled = xb * torch.pow(2.0, -shared.to(torch.float64)).unsqueeze(-1)  # exact in float64
    cand = torch.tensor(MAG, dtype=torch.float64)
    dist = (scaled.abs().unsqueeze(-1) - cand).abs()
    is_min = dist == dist.amin(-1, keepdim=True)
    odd = torch.arange(8) % 2
    pick = torch.where(is_min, odd, torch.full_like(odd, 2)).argmin(-1)  # prefer even code on ties
    codes = pick.to(torch.uint8) | (torch.signbit(xb).to(torch.uint8) << 3)
    return codes.reshape(w.shape), (shared + 127).to(torch.uint8)


def _random_blocks(rows: int, blocks: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Random data whose blocks span huge magnitude ranges, plus zero / -0 / tie / saturation blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks, BLOCK, generator=g)
    mag = torch.pow(2.0, torch.randint(-60, 60, (rows, blocks, 1), generator=g).float())
    x = x * mag
    # exact grid values and exact tie points at a random power of two
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.0, 4.0, 7.9, 0.3], dtype=torch.float32)
    idx = torch.randint(0, len(grid), (rows, BLOCK), generator=g)
    sign = torch.where(torch.rand(rows, BLOCK, generator=g) < 0.5, -1.0, 1.0)
    x[:, 0] = grid[idx] * sign * 2.0 ** 7
    x[:, 0, 0] = 4.0 * 2.0 ** 7  # pin the block max so the ties stay ties
    x[:, 1] = 0.0
    x[:, 2] = -0.0
    x[:, 3, :4] = torch.tensor([3.0e38, -3.3e38, 1.0, -1e-30])
    return x.reshape(rows, blocks * BLOCK).to(dtype)


# --------------------------------------------------------------------------- constants, packing


def test_constants():
    assert BLOCK == 32
    assert len(E2M1_VALUES) == 16
    assert list(E2M1_VALUES[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert list(E2M1_VALUES[8:]) == [-v for v in E2M1_VALUES[:8]]
    assert math.copysign(1.0, E2M1_VALUES[8]) == -1.0  # code 8 is -0
    assert math.copysign(1.0, E2M1_VALUES[0]) == 1.0


def test_code_values_computed_elementwise_equal_the_table_with_signs():
    """Dequantisation decodes codes arithmetically (no device table kept across calls, which broke
    CUDA-graph-trees warm-ups); every code, -0.0 included, gives the E2M1 table's value."""
    from k3compile.model.mxfp4 import _e2m1_values
    v = _e2m1_values(torch.arange(16, dtype=torch.uint8))
    t = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    assert torch.equal(v, t) and torch.equal(torch.signbit(v), torch.signbit(t))


def test_nibble_order_raw_bytes():
    codes = torch.tensor([1, 2, 3, 4, 15, 0, 0, 8], dtype=torch.uint8)
    packed = pack_fp4(codes)
    # element 2i -> bits 0-3, element 2i+1 -> bits 4-7
    assert packed.tolist() == [0x21, 0x43, 0x0F, 0x80]
    assert unpack_fp4(packed).tolist() == codes.tolist()


def test_pack_unpack_roundtrip_random():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(packed, codes[..., 0::2] + 16 * codes[..., 1::2])


# --------------------------------------------------------------------------- hand-checked blocks

HAND_CASES = [
    # amax 6 -> floor(log2 6) = 2, shared_exp = 2 - 2 = 0 -> byte 127; codes are the values themselves:
    # 0.5->1 1->2 | 1.5->3 6->7 | -0.5->9 -6->15 | 2->4 3->5 | 4->6 -1->10 | -1.5->11 -2->12 |
    # -3->13 -4->14 | 0->0 -0.0->8 | zeros
    pytest.param(
        [0.5, 1, 1.5, 6, -0.5, -6, 2, 3, 4, -1, -1.5, -2, -3, -4, 0.0, -0.0], 127,
        [0x21, 0x73, 0xF9, 0x54, 0xA6, 0xCB, 0xED, 0x80], id="all-codes-amax6",
    ),
    # amax 12 -> floor(log2 12) = 3, shared 1 -> byte 128; x/2: 12->6 (7), 1->0.5 (1) | -3->-1.5 (11),
    # 0.5->0.25 tie between 0 and 0.5 -> even -> 0
    pytest.param([12, 1, -3, 0.5], 128, [0x17, 0x0B], id="amax12-byte128"),
    # amax 4 -> shared 0, byte 127. Ties to even: 0.25->0, 0.75->1.0(2), 1.25->1.0(2), 1.75->2.0(4),
    # 2.5->2.0(4), 3.5->4.0(6), 5.0->4.0(6); -0.25->-0 (8), -0.75->-1 (10); 5.5 -> 6 (7), 0.3 -> 0.5 (1)
    pytest.param(
        [4, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, 5.5, 0.3], 127,
        [0x06, 0x22, 0x44, 0x66, 0xA8, 0x17], id="ties-to-even",
    ),
    # amax 7.9 -> floor(log2) = 2 -> byte 127 (FLOOR scale), so 7.9, -7.5, 6.5 saturate to +-6 (7, 15)
    pytest.param([7.9, -7.5, 6.5], 127, [0xF7, 0x07], id="saturation"),
    # amax 1 -> shared -2 -> byte 125; x*4: 1->4 (6), 0.125->0.5 (1) | 0.0625->0.25 tie -> 0, 0.1875->0.75 -> 1 (2)
    pytest.param([1, 0.125, 0.0625, 0.1875], 125, [0x16, 0x20], id="amax1-byte125"),
    # tiny: amax 6*2^-127 = 1.5*2^-125 -> floor(log2) -125 -> shared -127 -> byte 0; x*2^127: 6 (7),
    # 2^-128 -> 0.5 (1) | -2^-127 -> -1 (10), 0 -> 0
    pytest.param([6 * 2.0**-127, 2.0**-128, -(2.0**-127)], 0, [0x17, 0x0A], id="tiny-byte0"),
    # fp32-subnormal block: amax 2^-140 -> clamp -> byte 0; 2^-140*2^127 = 2^-13 rounds to +-0 (0, 8)
    pytest.param([2.0**-140, -(2.0**-140)], 0, [0x80], id="subnormal-byte0"),
    # all zeros -> byte 0, all codes 0
    pytest.param([], 0, [0x00] * 16, id="all-zero"),
    # huge: 6*2^100 -> floor(log2) 102 -> shared 100 -> byte 227, code 7; -2^100 -> -1 (10)
    pytest.param([6 * 2.0**100, -(2.0**100)], 227, [0xA7], id="huge-byte227"),
    # fp32 max 3.4e38 ~ 1.9986*2^127 -> shared 125 -> byte 252; /2^125 = 7.99 -> saturates to 6 (7)
    pytest.param([3.4e38], 252, [0x07], id="fp32max-byte252"),
]


@pytest.mark.parametrize("vals, scale_byte, first_bytes", HAND_CASES)
def test_hand_checked_blocks(vals, scale_byte, first_bytes):
    w = _block(vals)
    packed, scales = quantize(w)
    assert packed.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert packed.shape == (16,) and scales.shape == (1,)
    assert scales.tolist() == [scale_byte]
    expected = first_bytes + [0] * (16 - len(first_bytes))
    assert packed.tolist() == expected
    # the independent brute-force reference agrees
    codes_ref, scale_ref = _ref_quantize(w)
    assert torch.equal(unpack_fp4(packed), codes_ref)
    assert torch.equal(scales, scale_ref)


def test_negative_zero_block():
    packed, scales = quantize(_block([], fill=-0.0))
    assert scales.tolist() == [0]
    assert packed.tolist() == [0x88] * 16
    out = dequantize(packed, scales, torch.float32)
    assert torch.equal(out, torch.zeros(32)) and torch.signbit(out).all()


def test_two_blocks_scale_order_and_shapes():
    w = torch.cat([_block([6.0]), _block([12.0])]).reshape(1, 64).repeat(3, 1)
    packed, scales = quantize(w)
    assert packed.shape == (3, 32) and scales.shape == (3, 2)
    assert scales.tolist() == [[127, 128]] * 3
    assert packed[0, 0].item() == 0x07 and packed[0, 16].item() == 0x07


# --------------------------------------------------------------------------- against the brute-force reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_bruteforce_reference(dtype):
    w = _random_blocks(16, 8, seed=1)
    if dtype == torch.float16:
        w = torch.randn(16, 256, generator=torch.Generator().manual_seed(2)) * 100
    w = w.to(dtype)
    packed, scales = quantize(w)
    codes_ref, scales_ref = _ref_quantize(w)
    assert torch.equal(scales, scales_ref)
    assert torch.equal(unpack_fp4(packed), codes_ref)


def test_bf16_input_same_as_fp32_of_same_values():
    w = _random_blocks(4, 4, seed=3).to(torch.bfloat16)
    a = quantize(w)
    b = quantize(w.float())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_dim_argument():
    w = _random_blocks(4, 4, seed=4).reshape(2, 4, 64)
    packed, scales = quantize(w)
    wt = w.transpose(1, 2).contiguous()  # [2, 64, 4], K in dim 1
    p1, s1 = quantize(wt, dim=1)
    assert p1.shape == (2, 32, 4) and s1.shape == (2, 2, 4)
    assert torch.equal(p1, packed.transpose(1, 2)) and torch.equal(s1, scales.transpose(1, 2))
    assert torch.equal(dequantize(p1, s1, torch.float32, dim=1), dequantize(packed, scales, torch.float32).transpose(1, 2))


# --------------------------------------------------------------------------- dequantize / round trips


def test_dequantize_exact_values():
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (6, 64), generator=g, dtype=torch.uint8)
    scales = torch.tensor([[0, 1], [126, 127], [128, 200], [252, 251], [60, 127], [5, 250]], dtype=torch.uint8)
    out = dequantize(pack_fp4(codes), scales, torch.float32)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    ref = table[codes.long()].reshape(6, 2, 32) * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    assert torch.equal(out.double(), ref.reshape(6, 64))  # exact, incl. 2^-127 subnormal scales
    assert torch.equal(torch.signbit(out), torch.signbit(ref.reshape(6, 64)))
    # (scales <= 252 keep 6 * 2^(s-127) fp32-finite)
    # bf16 holds every code * 2^(s-127) for these scales exactly
    assert torch.equal(dequantize(pack_fp4(codes), scales).float(), out)
    # default dtype is bf16
    assert dequantize(pack_fp4(codes), scales).dtype == torch.bfloat16


def test_e8m0_to_float32():
    s = torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8)
    f = e8m0_to_float32(s)
    assert f[:5].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0, 2.0**127]
    assert math.isnan(f[5].item())
    out = dequantize(torch.full((16,), 0x22, dtype=torch.uint8), torch.tensor([255], dtype=torch.uint8), torch.float32)
    assert torch.isnan(out).all()  # scale byte 255 is NaN


def test_roundtrip_error_bound():
    w = _random_blocks(32, 8, seed=6)
    packed, scales = quantize(w)
    back = dequantize(packed, scales, torch.float32)
    wb = w.reshape(32, 8, BLOCK).double()
    err = (back.reshape(32, 8, BLOCK).double() - wb).abs()
    amax = wb.abs().amax(-1, keepdim=True)
    # FLOOR scale puts the scaled block max in [4, 8): rounding error <= 1 below 6, saturation < 2 above,
    # so |err| <= amax / 4 (for blocks not clamped at 2^-127)
    assert (err <= amax / 4 + 2.0**-129).all()
    # plain Gaussian data: mean relative error is small
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))
    rel = (dequantize(*quantize(x), dtype=torch.float32) - x).norm() / x.norm()
    assert rel < 0.12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_requantize_is_identity(dtype):
    """quantize(dequantize(q)) == q for canonical q (each block's max magnitude code is 4 or 6)."""
    g = torch.Generator().manual_seed(8)
    rows, nblk = 24, 6
    codes = torch.randint(0, 16, (rows, nblk, BLOCK), generator=g, dtype=torch.uint8)
    top = torch.randint(6, 8, (rows, nblk), generator=g, dtype=torch.uint8)
    top |= torch.randint(0, 2, (rows, nblk), generator=g, dtype=torch.uint8) << 3
    pos = torch.randint(0, BLOCK, (rows, nblk), generator=g)
    codes.scatter_(-1, pos.unsqueeze(-1), top.unsqueeze(-1))
    scales = torch.randint(0, 253, (rows, nblk), generator=g, dtype=torch.uint8)  # 6*2^125 is fp32-finite
    scales[0] = 0
    scales[1] = 252
    # an all-zero block is canonical only with byte 0; an s=0 block is canonical with any codes
    codes[2, 0] = 0
    scales[2, 0] = 0
    codes[3, 1] = torch.randint(0, 4, (BLOCK,), generator=g, dtype=torch.uint8)
    scales[3, 1] = 0
    packed = pack_fp4(codes.reshape(rows, nblk * BLOCK))
    p2, s2 = quantize(dequantize(packed, scales, dtype))
    assert torch.equal(s2, scales)
    assert torch.equal(p2, packed)


# --------------------------------------------------------------------------- meta tensors


def test_meta_tensors_shapes():
    p, s = quantize(torch.empty(4, 3, 128, device="meta", dtype=torch.bfloat16))
    assert p.shape == (4, 3, 64) and s.shape == (4, 3, 4) and p.device.type == "meta"
    out = dequantize(p, s, torch.float32)
    assert out.shape == (4, 3, 128) and out.dtype == torch.float32


# --------------------------------------------------------------------------- errors

U8 = torch.uint8


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize(torch.randn(4, 40)), "not a multiple of the MXFP4 block size 32"),
        (lambda: quantize(torch.randn(40, 4), dim=0), "K=40"),
        (lambda: quantize(torch.arange(64)), "floating-point"),
        (lambda: quantize(torch.tensor(1.0)), "0-d"),
        (lambda: quantize(torch.randn(64), dim=1), "out of range"),
        (lambda: quantize(torch.tensor([float("nan")] + [0.0] * 31)), "NaN or Inf"),
        (lambda: quantize(torch.tensor([float("inf")] + [0.0] * 31)), "NaN or Inf"),
        (lambda: dequantize(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=U8)), "packed must have dtype torch.uint8"),
        (lambda: dequantize(torch.zeros(4, 16, dtype=U8), torch.zeros(4, 1)), "scales must have dtype torch.uint8"),
        (lambda: dequantize(torch.zeros(4, 16, dtype=U8), torch.zeros(4, 1, dtype=torch.float8_e8m0fnu)), "view"),
        (lambda: dequantize(torch.zeros(4, 20, dtype=U8), torch.zeros(4, 1, dtype=U8)), "K = 2\\*20 = 40"),
        (lambda: dequantize(torch.zeros(4, 32, dtype=U8), torch.zeros(4, 1, dtype=U8)), "scales shape \\(4, 1\\) does not match"),
        (lambda: dequantize(torch.zeros(4, 16, dtype=U8), torch.zeros(3, 1, dtype=U8)), "expected scales shape \\(4, 1\\)"),
        (lambda: dequantize(torch.zeros(4, 16, dtype=U8), torch.zeros(4, dtype=U8)), "different rank"),
        (lambda: dequantize(torch.zeros(16, dtype=U8), torch.zeros(1, dtype=U8), torch.int32), "dtype must be a floating-point"),
        (lambda: pack_fp4(torch.zeros(3, dtype=U8)), "must be even"),
        (lambda: pack_fp4(torch.tensor([16, 0], dtype=U8)), "\\[0, 15\\]"),
        (lambda: pack_fp4(torch.zeros(4, dtype=torch.int32)), "codes must have dtype torch.uint8"),
        (lambda: unpack_fp4(torch.zeros(4, dtype=torch.int64)), "packed must have dtype torch.uint8"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- torchao cross-check


def test_bit_exact_vs_torchao():
    """Packed + scale bytes equal torchao 0.18 to_mx(x, float4_e2m1fn_x2, 32) (FLOOR mode).

    Exception, by design (see mxfp4.py docstring): in non-zero blocks whose scale byte is 0
    torchao divides by 2^-126 instead of 2^-127, so there its codes equal ours for x / 2.
    """
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    for dtype in (torch.float32, torch.bfloat16):
        x = _random_blocks(48, 8, seed=9, dtype=dtype)
        # tiny blocks with scale byte 0: x = m * 2^-135, |m| <= 1024 integer, so x / 2 is exact
        g = torch.Generator().manual_seed(10)
        m = torch.randint(-1024, 1025, (48, BLOCK), generator=g).float()
        tiny = (m * 2.0**-135).to(dtype)
        x[:, 4 * BLOCK:5 * BLOCK] = tiny
        x = x.contiguous()

        scale_ao, data_ao = mx.to_mx(x, torch.float4_e2m1fn_x2, BLOCK)
        scale_ao = scale_ao.view(torch.uint8)
        data_ao = data_ao.view(torch.uint8)
        packed, scales = quantize(x)
        assert scale_ao.shape == scales.shape and data_ao.shape == packed.shape
        assert torch.equal(scale_ao, scales)

        blocks = x.float().reshape(48, 8, BLOCK)
        quirk = (scales == 0) & (blocks.abs().amax(-1) > 0)  # [48, 8]
        assert quirk[:, 4].all()  # the tiny blocks are in it
        same = ~quirk.repeat_interleave(BLOCK // 2, dim=1)
        assert torch.equal(data_ao[same], packed[same])
        # in the quirk blocks torchao's codes are our codes of x / 2 (scale byte still 0)
        p_half, s_half = quantize(x.float() / 2)  # exact in fp32
        assert torch.equal(s_half[quirk], scales[quirk])
        assert torch.equal(data_ao[~same], p_half[~same])
