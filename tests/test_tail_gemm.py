"""The latent tail at TP=1 in one kernel (launch.tail_gemm, kernels/triton_resgemm.tail_gemm_kernel):
k3::moe_latent_tail's CUDA path where there is no all-reduce, the weighted top-k finalize and the
RMSNorm inside the up-projection's MMA decode GEMM and the shared partial added in its epilogue.

- CPU: the kernel in Triton's interpreter (fp32, fp16; the interpreter's bf16 dot is wrong) against
  the op's reference: M = 1..3, top-k 4 / 8 / 16, split-K, swapped, ragged K and N; the split
  counters left zero; what it refuses.
- GPU (`pytest -m gpu`): the op at the world-1 latent-up width (7168 x 3584, top-16) in bf16 with
  K3_TAIL_GEMM=1, M = 1 and 2 (the kernel) and 4 (64 rows: the latent-tail kernel + GEMM),
  eagerly and replayed from a CUDA graph with new inputs, against the reference and the two-kernel path.
"""
from __future__ import annotations

import os

import pytest
import torch

import k3compile.ops  # noqa: F401  (registers k3::)
from k3compile.ops import reference as ref

CASES = [
    (1, 16, 64, 128, (64, 64, 1, 4, 2, True), torch.float32),    # M=1 at top-16: one 16-row tile, swapped
    (2, 16, 96, 160, (32, 64, 2, 4, 2, False), torch.float16),   # 32 rows (BK halved), split, ragged K
    (1, 8, 70, 256, (64, 64, 3, 4, 2, False), torch.float32),    # ragged N, three splits
    (3, 4, 40, 64, (32, 32, 2, 4, 2, True), torch.float16),
]


def _inputs(M, topk, N, K, dt, gen, device="cpu"):
    mk = lambda *s: torch.randn(*s, generator=gen, device=device).to(dt)  # noqa: E731
    y, sp = mk(M, topk, K), mk(M, N)
    tw = torch.softmax(torch.randn(M, topk, generator=gen, device=device), -1) * 2.5   # fp32, as router_topk's
    g = (torch.rand(K, generator=gen, device=device) + 0.5).to(dt)
    w = (torch.randn(N, K, generator=gen, device=device) / K ** 0.5).to(dt)
    return y, tw, sp, g, w


def _rel(out, want):
    return ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter run (CPU CI)")
@pytest.mark.parametrize("M, topk, N, K, cfg, dt", CASES)
def test_tail_gemm_kernel_matches_reference_in_the_interpreter(M, topk, N, K, cfg, dt):
    """launch.tail_gemm = the op's reference to 1e-6 relative (fp32) or 2e-3 (fp16: the reference also
    rounds the normed row and the product before the add); and no further from the fp64 result than
    the reference is, times 1.5."""
    pytest.importorskip("triton")
    from k3compile.kernels import launch
    y, tw, sp, g, w = _inputs(M, topk, N, K, dt, torch.Generator().manual_seed(M * 100 + topk))
    out = launch.tail_gemm(y, tw, sp, g, 1e-5, w, launch.MmaCfg(*cfg))
    want = ref.moe_latent_tail(y, tw, sp, g, w, 1e-5, 0, None)
    exact = ref.moe_latent_tail(y.double(), tw.double(), sp.double(), g.double(), w.double(), 1e-5, 0, None)
    assert out.dtype == dt and out.shape == (M, N)
    assert _rel(out, want) < (1e-6 if dt == torch.float32 else 2e-3)
    assert (out.double() - exact).abs().max() <= 1.5 * (want.double() - exact).abs().max() + 1e-7
    if cfg[2] > 1:
        assert launch.split_counters(y.device).abs().max() == 0


def test_tail_gemm_refuses_what_it_cannot_do():
    from k3compile.kernels import launch
    cfg = launch.MmaCfg(16, 32, 1)
    assert launch.tail_gemm_fits(1, 16) and launch.tail_gemm_fits(2, 16) and launch.tail_gemm_fits(4, 8)
    assert not launch.tail_gemm_fits(3, 16) and not launch.tail_gemm_fits(17, 1) and not launch.tail_gemm_fits(0, 4)
    y, tw, sp, g, w = _inputs(3, 16, 8, 64, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="rows"):
        launch.tail_gemm(y, tw, sp, g, 1e-5, w, cfg)
    with pytest.raises(ValueError, match="contiguous"):
        launch.tail_gemm(y[:1].transpose(1, 2).contiguous().transpose(1, 2), tw[:1], sp[:1], g, 1e-5, w, cfg)
    with pytest.raises(ValueError, match="shared_partial"):
        launch.tail_gemm(y[:1], tw[:1], sp[:1, :4], g, 1e-5, w, cfg)


def test_tail_gemm_is_off_until_measured_and_the_knob_overrides(monkeypatch):
    """The CUDA dispatch takes the one-kernel form only where launch.TAIL_GEMM_M says (never, until it
    is measured on the GPU) or K3_TAIL_GEMM=1, and only where it fits."""
    from k3compile.kernels import launch
    monkeypatch.delenv("K3_TAIL_GEMM", raising=False)
    assert launch.tail_gemm_wanted(1, 16) == (launch.TAIL_GEMM_M[0] <= 1 <= launch.TAIL_GEMM_M[1])
    monkeypatch.setenv("K3_TAIL_GEMM", "1")
    assert launch.tail_gemm_wanted(1, 16) and not launch.tail_gemm_wanted(4, 16)
    monkeypatch.setenv("K3_TAIL_GEMM", "0")
    assert not launch.tail_gemm_wanted(1, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 2, 4])
def test_moe_latent_tail_tp1_on_cuda_bf16_eager_and_graphed(M, monkeypatch):
    """k3::moe_latent_tail at TP=1, bf16, the world-1 latent up (7168 x 3584, top-16) with K3_TAIL_GEMM=1:
    within 1e-2 relative of the reference and of the two-kernel path (K3_TAIL_GEMM=0), eagerly and
    replayed from a CUDA graph after new inputs are copied in. M=4 (64 rows) does not fit: the
    latent-tail kernel and the GEMM."""
    from k3compile.kernels import choose, launch
    N, K, topk = 7168, 3584, 16
    y, tw, sp, g, w = _inputs(M, topk, N, K, torch.bfloat16, torch.Generator("cuda").manual_seed(M), "cuda")
    assert isinstance(choose.gemv_plan(y[:, 0], w, sp), launch.MmaCfg)   # the tuned table runs it on the MMA GEMM
    monkeypatch.setenv("K3_TAIL_GEMM", "0")
    two = torch.ops.k3.moe_latent_tail(y, tw, sp, g, w, 1e-5, 0, None, [])
    monkeypatch.setenv("K3_TAIL_GEMM", "1")

    def check(out):
        want = ref.moe_latent_tail(y, tw, sp, g, w, 1e-5, 0, None)
        assert _rel(out, want) < 1e-2

    out = torch.ops.k3.moe_latent_tail(y, tw, sp, g, w, 1e-5, 0, None, [])
    check(out)
    assert _rel(out, two) < 1e-2
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.k3.moe_latent_tail(y, tw, sp, g, w, 1e-5, 0, None, [])
    y2, tw2, sp2, _, _ = _inputs(M, topk, N, K, torch.bfloat16, torch.Generator("cuda").manual_seed(M + 50), "cuda")
    for t, v in ((y, y2), (tw, tw2), (sp, sp2)):
        t.copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    check(out)
    assert launch.split_counters(y.device).abs().max() == 0
