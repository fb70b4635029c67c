"""fold_resnorm_gemm: the layer-input residual add + AttnRes / RMSNorm at TP=1 folded into the decode
GEMM that reads it (k3::residual_norm_gemm, kernels/triton_resgemm.py).

- CPU: the pass fires on the model's form (add, AttnRes mixer, linear) and the compiled step equals
  eager exactly (the op's reference); a normed row read twice is a near-miss with its reason. (The
  tiny model's count, every layer but the first, and the TP=2 skip: test_compiler.py.)
- The kernel in Triton's CPU interpreter (fp32, fp16; the interpreter's bf16 dot is wrong): 0 to 8
  blocks, M = 1..4, split-K, swapped, ragged K and N, against the op's reference; `updated` exact;
  the split counters left zero.
- GPU (`pytest -m gpu`): the op at the KDA in_proj and MLA qkv_a widths in bf16 (their tuned MMA
  configs, unsplit and split), M = 1 and 2 with 3 blocks and none, eagerly and replayed from a CUDA
  graph with new inputs; M = 4 with 3 blocks (20 rows: no tile) takes the two-kernel path.
"""
from __future__ import annotations

import os

import pytest
import torch

import k3compile
import k3compile.ops  # noqa: F401  (registers k3::)
from k3compile.model.functional import attnres_mix
from k3compile.ops import reference as ref


def _step(variant):
    def fn(prefix, delta, b0, b1, wn, wq, g, w, attn):
        normed, updated = attnres_mix(prefix, delta, [b0, b1], wn, wq, g, 1e-5)
        y = torch.nn.functional.linear(normed, w)
        o = torch.ops.k3model.mla_decode(*attn, 0.25)   # an attention core: K3 structure for the passes
        return (y + normed[:, :1] if variant == "read twice" else y), updated, o
    return fn


@pytest.mark.parametrize("variant, why", [("model", None), ("read twice", "read by 2 nodes")])
def test_fold_resnorm_gemm_matches_or_says_why(variant, why):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen).bfloat16()  # noqa: E731
    args = [r(2, 48), r(2, 48), r(2, 48), r(2, 48)] + [(torch.rand(48, generator=gen) + 0.5).bfloat16() for _ in range(3)]
    args.append(r(40, 48))
    attn = [r(2, 2, 16), r(2, 2, 16), r(2, 32), r(2, 8, 32), torch.tensor([3, 5])]
    want = _step(variant)(*args, [a.clone() for a in attn])
    torch._dynamo.reset()
    k3compile.clear_reports()
    fn = torch.compile(_step(variant), fullgraph=True, dynamic=False, backend=k3compile.backend(
        mode="eager", passes=["fuse_residual_norm", "lower_decode_gemm", "fold_resnorm_gemm"]))
    got = fn(*args, attn)
    rep = k3compile.last_report()
    assert rep.get("fuse_residual_norm").matched == 1
    p = rep.get("fold_resnorm_gemm")
    assert p.error is None and p.skipped is None and p.expected == 1
    if why is None:
        assert p.matched == 1 and not p.near_misses
    else:
        assert p.matched == 0 and len(p.near_misses) == 1 and why in p.near_misses[0].reason, p.near_misses
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fold_resnorm_gemm_is_skipped_at_tp2_with_its_reason():
    from k3compile.options import K3Options
    from k3compile.passes.fold_resnorm_gemm import FoldResnormGemm
    from k3compile.patterns.structure import GraphInfo
    info = GraphInfo()
    info.tp = 2
    why = FoldResnormGemm().skip_reason(info, K3Options.make(mode="eager"))
    assert why is not None and why.startswith("TP=2:") and "TP=1 only" in why


CASES = [  # M, blocks, N, K, MmaCfg args, dtype
    (1, 3, 40, 96, (16, 32, 1), torch.float32),
    (1, 0, 40, 96, (16, 32, 1), torch.float32),
    (2, 3, 37, 100, (16, 32, 3), torch.float16),          # ragged K and N, a split
    (4, 1, 64, 128, (32, 64, 2, 4, 4, True), torch.float32),  # swapped, 16 rows exactly
    (1, 8, 48, 64, (16, 16, 4), torch.float32),           # every block argument
    (3, 2, 70, 130, (64, 32, 4, 4, 4, True), torch.float16),
]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter run (CPU CI)")
@pytest.mark.parametrize("M, nb, N, K, cfg, dt", CASES)
def test_resnorm_gemm_kernel_matches_reference_in_the_interpreter(M, nb, N, K, cfg, dt):
    """launch.resnorm_gemm = the op's reference: `updated` exact, the product to 1e-5 relative (fp32)
    or 3e-3 (fp16: the reference rounds the normed row, the kernel only x * g)."""
    pytest.importorskip("triton")
    from k3compile.kernels import launch
    gen = torch.Generator().manual_seed(M * 100 + nb)
    mk = lambda *s: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    delta, res, w = mk(M, K), mk(M, K), mk(N, K)
    blocks = [mk(M, K) * (1 + i) for i in range(nb)]
    wn, wq, g = [(torch.rand(K, generator=gen) + 0.5).to(dt) for _ in range(3)]
    want_upd, want = ref.residual_norm_gemm(delta, res, blocks, wn, wq, g, 1e-5, w)
    upd, out = launch.resnorm_gemm(delta, res, blocks, wn, wq, g, 1e-5, w, launch.MmaCfg(*cfg))
    assert torch.equal(upd, want_upd)
    err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < (1e-5 if dt == torch.float32 else 3e-3), err
    if cfg[2] > 1:
        assert launch.split_counters(res.device).abs().max() == 0


def test_resnorm_gemm_refuses_what_it_cannot_do():
    from k3compile.kernels import launch
    x, w = torch.randn(4, 64), torch.randn(8, 64)
    cfg = launch.MmaCfg(16, 32, 1)
    assert launch.resnorm_gemm_fits(2, 6) and not launch.resnorm_gemm_fits(4, 3) and not launch.resnorm_gemm_fits(1, 9)
    with pytest.raises(ValueError, match="rows"):
        launch.resnorm_gemm(x, x, [x, x, x], None, None, torch.ones(64), 1e-5, w, cfg)
    with pytest.raises(ValueError, match="contiguous"):
        launch.resnorm_gemm(x[:2], x[:2], [torch.randn(64, 2).t()], None, None, torch.ones(64), 1e-5, w, cfg)


# real widths: (N, K) of the KDA in_proj and the MLA qkv_a at TP=8
GPU_SHAPES = [(6284, 7168), (3648, 7168)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("N, K", GPU_SHAPES)
@pytest.mark.parametrize("M, nb", [(1, 3), (2, 3), (1, 0), (4, 3)])
@pytest.mark.parametrize("card", ["none", "auto"])
def test_residual_norm_gemm_on_cuda_bf16_eager_and_graphed(N, K, M, nb, card, monkeypatch):
    """k3::residual_norm_gemm in bf16 against its reference (1e-2 relative; `updated` exact), eagerly
    and replayed from a CUDA graph after new inputs are copied in. M=4 with 3 blocks does not fit the
    tile: the residual / norm kernel and the decode GEMM instead. card="none": GEMV_TABLE alone, whose
    MMA config the fused kernel takes; "auto": this GPU's card rows (choose.GEMV_TABLE_BY_CARD), where
    they give the shape a CUDA-core GEMV config (the H100's in_proj rows at M=1): the op runs the
    residual / norm kernel and that GEMV instead."""
    from k3compile.kernels import choose, launch
    monkeypatch.setenv("K3_GEMV_CARD", card) if card == "none" else monkeypatch.delenv("K3_GEMV_CARD", raising=False)
    if card == "auto" and M not in {m for m in choose.card_rows(torch.device("cuda", 0)).get((N, K), {})}:
        pytest.skip("no card row for this shape and M on this GPU")
    gen = torch.Generator("cuda").manual_seed(M * 10 + nb)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16()  # noqa: E731
    delta, res = mk(M, K), mk(M, K)
    blocks = [mk(M, K) for _ in range(nb)]
    wn, wq, g = [(torch.rand(K, device="cuda", generator=gen) + 0.5).bfloat16() for _ in range(3)]
    w = (torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).bfloat16()
    plan = choose.gemv_plan(delta, w)
    assert isinstance(plan, launch.MmaCfg) if card == "none" else isinstance(plan, tuple), plan
    fused = launch.resnorm_gemm_fits(M, nb)
    assert fused == (M * (nb + 2) <= 16)

    def check(upd, out):
        want_upd, want = ref.residual_norm_gemm(delta, res, blocks, wn, wq, g, 1e-5, w)
        assert torch.equal(upd, want_upd)
        err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err < 1e-2, err

    check(*torch.ops.k3.residual_norm_gemm(delta, res, blocks, wn, wq, g, 1e-5, w))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        upd, out = torch.ops.k3.residual_norm_gemm(delta, res, blocks, wn, wq, g, 1e-5, w)
    for t in (delta, res, *blocks):
        t.copy_(mk(M, K))
    graph.replay()
    torch.cuda.synchronize()
    check(upd, out)
    if fused and isinstance(plan, launch.MmaCfg) and plan.split > 1:  # the split-K counters are zero again
        assert launch.split_counters(delta.device).abs().max() == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter run (CPU CI)")
@pytest.mark.parametrize("M, nb, N1, N2, K, cfg, dt", [(1, 3, 32, 40, 96, (16, 32, 1), torch.float32),
                                                       (2, 2, 64, 37, 130, (32, 32, 3, 4, 4, True), torch.float16)])
def test_resnorm_gemm_two_weights_in_one_launch(M, nb, N1, N2, K, cfg, dt):
    """TWO (the MoE input's router + latent down-projection at TP=1): [w1; w2] stacked in one launch,
    each output equal to the reference's product with its weight; upd exact, into a given buffer."""
    pytest.importorskip("triton")
    from k3compile.kernels import launch
    gen = torch.Generator().manual_seed(M + nb)
    mk = lambda *s: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    delta, res, w1, w2 = mk(M, K), mk(M, K), mk(N1, K), mk(N2, K)
    blocks = [mk(M, K) for _ in range(nb)]
    wn, wq, g = [(torch.rand(K, generator=gen) + 0.5).to(dt) for _ in range(3)]
    want_upd, want = ref.residual_norm_gemm(delta, res, blocks, wn, wq, g, 1e-5, torch.cat([w1, w2]))
    buf = torch.empty_like(res)
    upd, o1, o2 = launch.resnorm_gemm(delta, res, blocks, wn, wq, g, 1e-5, w1, launch.MmaCfg(*cfg), w2=w2, upd=buf)
    assert upd is buf and torch.equal(upd, want_upd)
    err = ((torch.cat([o1, o2], 1).float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < (1e-5 if dt == torch.float32 else 3e-3), err
    with pytest.raises(ValueError, match="multiple"):
        launch.resnorm_gemm(delta, res, blocks, wn, wq, g, 1e-5, w1[:N1 - 1], launch.MmaCfg(*cfg), w2=w2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M, nb", [(1, 3), (2, 3), (4, 3)])
def test_post_attention_folds_on_cuda_bf16(M, nb):
    """fold_resnorm_moe's ops at TP=1 with TP=8 expert widths: the router + latent down-projection
    (896 + 3584 rows, one launch over both weights) and the shared expert (gate-up 1536 rows, on the
    side stream) of the AttnRes-normed residual + delta, in bf16, against their references (1e-2
    relative; `updated` exact). M=4 with 3 blocks takes the norm kernel first."""
    from k3compile.runtime import streams
    gen = torch.Generator("cuda").manual_seed(M * 7 + nb)
    K = 7168
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16()  # noqa: E731
    delta, res = mk(M, K), mk(M, K)
    blocks = [mk(M, K) for _ in range(nb)]
    wn, wq, g = [(torch.rand(K, device="cuda", generator=gen) + 0.5).bfloat16() for _ in range(3)]
    wr, wd = mk(896, K) / K ** 0.5, mk(3584, K) / K ** 0.5
    wgu, wdn = mk(1536, K) / K ** 0.5, mk(K, 768) / 768 ** 0.5
    args = (delta, res, blocks, wn, wq, g, 1e-5)

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    upd, logits, lat = torch.ops.k3.residual_norm_router_latent(*args, wr, wd)
    want = ref.residual_norm_router_latent(*args, wr, wd)
    assert torch.equal(upd, want[0]) and rel(logits, want[1]) < 1e-2 and rel(lat, want[2]) < 1e-2
    sh = torch.ops.k3.shared_expert_async_resnorm(*args, wgu, wdn, 4.0, 25.0)
    streams.join(sh)
    assert rel(sh, ref.shared_expert_resnorm(*args, wgu, wdn, 4.0, 25.0)) < 2e-2
