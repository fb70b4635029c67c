"""GPU tests (`pytest -m gpu`): the norm kernels in a model's own rounding order, on CUDA in bf16.

A K3 model written otherwise than the reference model rounds its norms and its AttnRes mixer in
another order (k3compile/rounding.py); the patterns record it and the ops pass it to their kernels.
Each kernel here runs in one such order and must equal the op's reference in that order within bf16
(atol = rtol = 2e-2), and be closer to it than to the reference model's order (fewer differing
elements) wherever the two orders differ: so a kernel that ignored the bit fails.
"""
from __future__ import annotations

import pytest
import torch

from k3compile.ops import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DT = torch.bfloat16


def _closer(got, want, other):
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    if not torch.equal(want, other):
        assert int((got != want).sum()) < int((got != other).sum()), \
            (int((got != want).sum()), int((got != other).sum()), got.numel())


@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("rounding,mix_rounding", [
    (ref.NORM_CAST_FIRST, 0), (0, ref.MIX_KEY_FP32), (0, ref.MIX_SUM_FP32),
    (ref.NORM_CAST_FIRST, ref.MIX_KEY_FP32 | ref.MIX_SUM_FP32)])
def test_residual_norm_kernel_follows_the_rounding_order(M, rounding, mix_rounding):
    """comm.ar_residual_norm at TP=1 (the o-proj / layer-input norm with the AttnRes mixer over 3
    blocks, K3's hidden 7168) against ops.reference.attnres_mix_as in the same order."""
    from k3compile.kernels import comm
    g = torch.Generator(device="cuda").manual_seed(7 + M)
    N = 7168
    rn = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(DT)  # noqa: E731
    y, resid = rn(M, N), rn(M, N)
    blocks = [rn(M, N, scale=1 + i) for i in range(3)]
    w_norm, gam = rn(N, scale=0.2) + 1, rn(N, scale=0.2) + 1
    w_qk = rn(N, scale=6 / N ** 0.5)
    upd, nrm = comm.ar_residual_norm(y, None, resid, gam, w_norm, w_qk, blocks, 1e-5, None,
                                     comm.rnd_bits(rounding, mix_rounding))
    want, want_upd = ref.attnres_mix_as(resid, y, blocks, w_norm, w_qk, gam, 1e-5, rounding, mix_rounding)
    other, _ = ref.attnres_mix_as(resid, y, blocks, w_norm, w_qk, gam, 1e-5, 0, 0)
    torch.testing.assert_close(upd, want_upd, atol=2e-2, rtol=2e-2)
    _closer(nrm, want, other)


@pytest.mark.parametrize("M", [1, 4])
def test_mla_prologue_kernel_follows_the_cast_first_norm(M):
    """attention.mla_decode with kv_norm in the cast-first order (transformers-style latent norm): the
    cache row it writes against ops.reference.mla_decode_normed in that order."""
    from k3compile.kernels import attention
    g = torch.Generator(device="cuda").manual_seed(11 + M)
    H, L, R, S = 16, 512, 64, 256
    rn = lambda *s: torch.randn(*s, generator=g, device="cuda").to(DT)  # noqa: E731
    q_lat, q_rope, kv_a = rn(M, H, L), rn(M, H, R), rn(M, L + R)
    w = (torch.randn(L, generator=g, device="cuda") * 0.2 + 1).to(DT)
    cache = rn(M, S, L + R)
    lens = torch.randint(1, S - 1, (M,), generator=g, device="cuda")
    c_want, c_other, c_got = cache.clone(), cache.clone(), cache.clone()
    o_want = ref.mla_decode_normed(q_lat, q_rope, kv_a, w, 1e-6, c_want, lens, L ** -0.5, ref.NORM_CAST_FIRST)
    ref.mla_decode_normed(q_lat, q_rope, kv_a, w, 1e-6, c_other, lens, L ** -0.5)
    assert attention.mla_decode_fits(q_lat, q_rope, kv_a, c_got)
    o = attention.mla_decode(q_lat, q_rope, kv_a, c_got, lens, L ** -0.5, kv_norm=(w, 1e-6, ref.NORM_CAST_FIRST))
    torch.testing.assert_close(o, o_want, atol=2e-2, rtol=2e-2)
    ar = torch.arange(M, device="cuda")
    _closer(c_got[ar, lens], c_want[ar, lens], c_other[ar, lens])
