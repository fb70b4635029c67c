"""fold_router_topk's kernels: the router's selection in the router + latent launch (launch.TopkEpilogue,
triton_router.topk_after_tile), in Triton's CPU interpreter (fp32, fp16): the ids equal router_topk's
reference on the launch's own logits, the weights to 1e-6, the logits to the GEMM's, the counters left
zero; both the MMA GEMM kernel's epilogue and the norm-folded kernel's. (The pass on the tiny model at
TP=1, every MoE layer, exact: test_compiler.py's "all" pass set.)"""
from __future__ import annotations

import os

import pytest
import torch

import k3compile.ops  # noqa: F401  (registers k3::)
from k3compile.ops import reference as ref

CASES = [(1, 64, 48, 64, 8, (16, 32, 1), torch.float32),
         (2, 96, 32, 96, 6, (32, 32, 3, 4, 2, True), torch.float16),
         (3, 128, 64, 64, 16, (32, 64, 2, 4, 2, False), torch.float32)]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter run (CPU CI)")
@pytest.mark.parametrize("M, E, L, K, k, cfg, dt", CASES)
def test_topk_in_the_router_launch_matches_router_topk(M, E, L, K, k, cfg, dt, monkeypatch):
    pytest.importorskip("triton")
    from k3compile.kernels import launch

    def no_kernel(*a, **kw):
        raise AssertionError("the selection ran as its own kernel")
    gen = torch.Generator().manual_seed(M * 10 + k)
    mk = lambda *s: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    x, wr, wd, b = mk(M, K), mk(E, K) / 8, mk(L, K) / 8, torch.randn(E, generator=gen) * 0.1
    monkeypatch.setattr(launch, "router_topk", no_kernel)
    lg, lat, ids, w = launch.router_latent_topk(x, wr, wd, b, k, 2.5, torch.int32, cfg=launch.MmaCfg(*cfg))
    tol = 1e-5 if dt == torch.float32 else 2e-3
    assert (lg.float() - torch.nn.functional.linear(x, wr).float()).abs().max() < tol * 10
    assert (lat.float() - torch.nn.functional.linear(x, wd).float()).abs().max() < tol * 10
    rids, rw = ref.router_topk(lg, b, k, 2.5, True)
    assert ids.dtype == torch.int32 and torch.equal(ids, rids)
    assert (w - rw).abs().max() < 1e-6
    assert launch.split_counters(x.device).abs().max() == 0
    if 4 * M <= 16:   # the norm-folded form (2 blocks): its launch's epilogue
        delta, res = mk(M, K), mk(M, K)
        blocks = [mk(M, K) for _ in range(2)]
        wn, wq, g = [(torch.rand(K, generator=gen) + 0.5).to(dt) for _ in range(3)]
        upd, lg2, lat2, ids2, w2 = launch.resnorm_router_latent(delta, res, blocks, wn, wq, g, 1e-5, wr, wd,
                                                                topk=(b, k, 2.5, torch.int64), cfg=launch.MmaCfg(*cfg))
        rids2, rw2 = ref.router_topk(lg2, b, k, 2.5, False)
        assert ids2.dtype == torch.int64 and torch.equal(ids2, rids2) and (w2 - rw2).abs().max() < 1e-6
        assert launch.split_counters(x.device).abs().max() == 0


def test_the_shared_expert_resnorm_op_takes_its_cuda_path_at_real_shapes():
    """k3::shared_expert_async_resnorm's CUDA check takes the shared expert's weights (gate-up [2 I, H],
    down [H, I]): a check written for two weights of one K sent it to its PyTorch reference on the GPU."""
    from k3compile.kernels import cuda
    H, I, M = 64, 48, 1
    x = torch.randn(M, H, dtype=torch.bfloat16)
    g = torch.ones(H, dtype=torch.bfloat16)
    wgu, wd = torch.randn(2 * I, H, dtype=torch.bfloat16), torch.randn(H, I, dtype=torch.bfloat16)
    assert cuda._ok_shared_resnorm(x, x.clone(), [], None, None, g, 1e-5, wgu, wd, 4.0, 25.0, None)
    assert not cuda._ok_shared_resnorm(x, x.clone(), [], None, None, g, 1e-5, wgu, wd.t().contiguous()[:, :H],
                                       4.0, 25.0, None)
