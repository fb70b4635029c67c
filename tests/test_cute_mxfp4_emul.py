"""CPU check of the CuTe MXFP4 expert kernel's arithmetic (`kernels/cute/mxfp4_ref.py`, the
PyTorch emulation of `kernels/cute/mxfp4_experts.py`'s bit tricks and summation order) against
`k3compile.model.mxfp4` and the model op's reference. No DSL, no GPU."""
from __future__ import annotations

import torch

from k3compile.kernels.cute import mxfp4_ref as R
from k3compile.model import mxfp4
from k3compile.model.moe_ops import mxfp4_experts_reference
from _mxfp4_data import random_experts  # noqa: E402


def test_pair_bits_decode_every_code_pair_exactly():
    # every byte value in every byte position of a word: all 16 codes in all 8 nibbles
    vals = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float32)
    b = torch.arange(256, dtype=torch.int64)
    for pos in range(4):
        word = (b << (8 * pos)) | (0xA5 << (8 * ((pos + 1) % 4)))    # garbage in another byte
        for k in range(4):
            hi, lo = R.pair_bits(word, k)
            codes = (word >> (4 * k)) & 0xF, (word >> (4 * (k + 4))) & 0xF
            assert torch.equal(lo, vals[codes[0]] * 2.0 ** -126), (pos, k)
            assert torch.equal(hi, vals[codes[1]] * 2.0 ** -126), (pos, k)
            assert torch.equal(torch.signbit(lo), codes[0] >= 8) and torch.equal(torch.signbit(hi), codes[1] >= 8)


def test_scale_bits_and_prescaled_products_are_exact():
    s = torch.arange(0, 229, dtype=torch.uint8)
    want = mxfp4.e8m0_to_float32(s).double() * 2.0 ** 26
    assert torch.equal(R.scale_f32(s).double(), want)
    # value * 2^-126 * (x * 2^100) is exact and normal for bf16 x of ordinary magnitude, incl. +-0.5
    vals = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float32) * 2.0 ** -126
    x = torch.tensor([1.0, -3.140625, 1e-3, 2.0 ** -20, 448.0], dtype=torch.bfloat16).float() * R.PRESCALE
    prod = vals[:, None] * x[None, :]
    assert torch.equal(prod.double(), vals.double()[:, None] * x.double()[None, :])
    nz = prod != 0
    assert (prod[nz].abs() >= torch.finfo(torch.float32).tiny).all()


def test_block_dot_matches_dequantize_for_random_rows_and_scales():
    g = torch.Generator().manual_seed(0)
    R_, KB = 24, 128
    packed = torch.randint(0, 256, (R_, KB), generator=g, dtype=torch.uint8)
    for lo, hi in ((118, 124), (100, 140), (0, 8), (200, 229)):
        scales = torch.randint(lo, hi, (R_, KB // 16), generator=g, dtype=torch.uint8)
        vec = torch.randn(2 * KB, generator=g).bfloat16().float()
        want = mxfp4.dequantize(packed, scales, torch.float64) @ vec.double()
        got = R.rows_dot(packed, scales, vec, q=2).double()
        # the kernel's result before the 2^-26 of the pre-scale is folded: rows_dot already folds it
        tol = 1e-5 * (mxfp4.dequantize(packed, scales, torch.float64).abs() @ vec.double().abs()) + 1e-300
        assert ((got - want).abs() <= tol).all(), (lo, hi, (got - want).abs().max())


def _experts_case(seed: int, E: int, N: int, I: int = 128, L: int = 512, K: int = 4):
    """Random experts, bf16 tokens and routing, and the model op's reference output (fp32)."""
    g = torch.Generator().manual_seed(seed)
    w13, s13, w2, s2 = random_experts(E, I, L, g)
    x = torch.randn(N, L, generator=g).bfloat16()
    ids = torch.randint(0, E, (N, K), generator=g, dtype=torch.int32)
    args = (x, ids, w13, s13, w2, s2, 4.0, 25.0)
    return args, mxfp4_experts_reference(*args).float()


def _rel_err(got, ref) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def test_emulated_kernels_match_model_reference():
    args, ref = _experts_case(1, E=6, N=3)
    got = R.emulate_mxfp4_experts(*args, bi=4, bl=64, groups_d=16)  # Q = 2 and 1
    assert _rel_err(got, ref) <= 1e-2


# ---------------------------------------------------------------- math="f16x2" (the _h2 artifacts)

def test_half_pair_bits_decode_every_code_pair_exactly():
    vals = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float32)
    b = torch.arange(256, dtype=torch.int64)
    for pos in range(4):
        word = (b << (8 * pos)) | (0x5A << (8 * ((pos + 2) % 4)))
        for k in range(4):
            lo, hi = R.half_pair_bits(word, k)
            codes = (word >> (4 * k)) & 0xF, (word >> (4 * (k + 4))) & 0xF
            assert torch.equal(lo.float(), vals[codes[0]] * 2.0 ** -14), (pos, k)
            assert torch.equal(hi.float(), vals[codes[1]] * 2.0 ** -14), (pos, k)
            assert torch.equal(torch.signbit(lo), codes[0] >= 8) and torch.equal(torch.signbit(hi), codes[1] >= 8)


def test_pb_pair_bits_decode_every_code_pair_exactly():
    """deq="prmt": the E / O bytes and the byte permute give every code's value, in the pairs the
    kernel pairs with its activations (mxfp4_experts.PB_PAIRS, mirrored in mxfp4_ref)."""
    vals = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float32)
    b = torch.arange(256, dtype=torch.int64)
    seen = []
    for pos in range(4):
        word = (b << (8 * pos)) | (0xA5 << (8 * ((pos + 1) % 4))) | (0x7F << (8 * ((pos + 3) % 4)))
        for i in range(4):
            lo, hi = R.pb_pair_bits(word, i)
            cl, ch = R.PB_PAIRS[i]
            codes = (word >> (4 * cl)) & 0xF, (word >> (4 * ch)) & 0xF
            assert torch.equal(lo.float(), vals[codes[0]] * 2.0 ** -14), (pos, i)
            assert torch.equal(hi.float(), vals[codes[1]] * 2.0 ** -14), (pos, i)
            assert torch.equal(torch.signbit(lo), codes[0] >= 8) and torch.equal(torch.signbit(hi), codes[1] >= 8)
            seen += [cl, ch]
    assert sorted(set(seen)) == list(range(8))      # every code of a word, once per pair set
    from k3compile.kernels.cute import mxfp4_ref
    src = open(mxfp4_ref.__file__.replace("mxfp4_ref", "mxfp4_experts")).read()
    assert "PB_PAIRS = " + repr(R.PB_PAIRS) in src   # the kernel's pairing is the emulated one


def test_pb_rows_dot_sums_in_its_own_order():
    """The two dequantisations give the same values in a different f16x2 accumulation order: equal
    within fp16 rounding, not bit-identical (so the emulation really follows the pairing)."""
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (32, 128), generator=g, dtype=torch.uint8)
    scales = torch.randint(115, 125, (32, 8), generator=g, dtype=torch.uint8)
    vec = torch.randn(256, generator=g).bfloat16().float()
    sh = R.rows_dot_h2(packed, scales, vec, q=4)
    pb = R.rows_dot_h2(packed, scales, vec, q=4, deq="prmt")
    want = mxfp4.dequantize(packed, scales, torch.float64) @ vec.double()
    bound = 2e-3 * (mxfp4.dequantize(packed, scales, torch.float64).abs() @ vec.double().abs())
    assert ((pb.double() - want).abs() <= bound).all() and not torch.equal(sh, pb)


def test_half_x_scale_keeps_block_max_in_range():
    x = torch.tensor([[3.0] + [0.0] * 31, [1e-30] + [0.0] * 31, [0.0] * 32, [6e4] + [-1e-3] * 31])
    ex = R.x_scale_exp(x)
    assert ex.tolist() == [128, 27, 20, 142]
    scaled = x.abs().amax(-1) * torch.pow(2.0, (139 - ex).double()).float()
    assert (scaled[[0, 1, 3]] >= 2 ** 12).all() and (scaled < 2 ** 13).all()


def test_half_rows_dot_close_to_dequantize_over_wide_activation_ranges():
    g = torch.Generator().manual_seed(3)
    R_, KB = 16, 256
    packed = torch.randint(0, 256, (R_, KB), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 130, (R_, KB // 16), generator=g, dtype=torch.uint8)
    for mag in (1.0, 1e-6, 1e4, 1e30):
        vec = (torch.randn(2 * KB, generator=g) * mag * torch.logspace(-3, 3, 2 * KB)).bfloat16().float()
        wd = mxfp4.dequantize(packed, scales, torch.float64)
        want = wd @ vec.double()
        got = R.rows_dot_h2(packed, scales, vec, q=4).double()
        bound = 2e-3 * (wd.abs() @ vec.double().abs())
        assert ((got - want).abs() <= bound).all(), (mag, ((got - want).abs() / bound).max())


def test_half_emulated_kernels_match_model_reference():
    """f16x2 math with mid in fp32 (the m32 alternate) and in bf16 (the default f16x2 kernels: down
    reads half the bytes); the bf16 rounding changes the result, both stay within 1e-2."""
    args, ref = _experts_case(4, E=5, N=2)
    kw = dict(bi=4, bl=64, groups_d=16, math="f16x2")
    f32 = R.emulate_mxfp4_experts(*args, **kw)
    bf16 = R.emulate_mxfp4_experts(*args, mid="bf16", **kw)
    assert _rel_err(f32, ref) <= 1e-2 and _rel_err(bf16, ref) <= 1e-2 and not torch.equal(f32, bf16)
    pb = R.emulate_mxfp4_experts(*args, mid="bf16", deq="prmt", **kw)
    assert _rel_err(pb, ref) <= 1e-2
