"""GPU tests (`pytest -m gpu`, run on the device machine): the compiler on CUDA.

- the `k3::` ops on CUDA equal their references (the side-stream pair included);
- the compiled tiny K3 model under reduce-overhead really runs as CUDA graphs (no skip) and
  equals the same graph run op by op (k3's eager mode) within bf16 kernel rounding;
- a profiler trace shows the shared expert on a second stream, overlapping the routed experts.
"""
from __future__ import annotations

import pytest

from k3compile.config import knobs_text
import torch

import k3compile
import k3compile.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3compile.model import K3Config, K3Model
from _mxfp4_data import random_experts  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _passes_on(monkeypatch):
    """These tests check what the passes and kernels do on the GPU, so the profitability gate (which
    skips passes and the prefetch on CUDA + Inductor outside their pipeline rows' CUDA ranges) is off."""
    monkeypatch.setenv("K3_GATE", "off")


def test_side_stream_ops_match_reference():
    from k3compile.model.functional import situ_mlp
    torch.manual_seed(0)
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    wgu = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16) / 8
    wdn = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16) / 8
    after = torch.ones(1, device="cuda")
    h = torch.ops.k3.shared_expert_async(x, wgu, wdn, 4.0, 25.0)
    out = torch.ops.k3.stream_join(h, after)
    torch.testing.assert_close(out, situ_mlp(x, wgu, wdn, 4.0, 25.0))


@pytest.mark.parametrize("M", [1, 16])
def test_shared_expert_with_separate_gate_and_up_graphed(M):
    """k3::shared_expert_async with w_up (a model's separate gate and up weights, at real per-rank TP=8
    widths): both GEMMs, the SiTU kernel and the down GEMM on the side stream, in a CUDA graph."""
    from k3compile.model.functional import situ_mlp
    torch.manual_seed(0)
    x = torch.randn(M, 7168, device="cuda", dtype=torch.bfloat16)
    wg, wu = (torch.randn(768, 7168, device="cuda", dtype=torch.bfloat16) / 85 for _ in range(2))
    wdn = torch.randn(7168, 768, device="cuda", dtype=torch.bfloat16) / 28
    after = torch.ones(1, device="cuda")

    def fn():
        return torch.ops.k3.stream_join(torch.ops.k3.shared_expert_async(x, wg, wdn, 4.0, 25.0, None, wu), after)
    ref = situ_mlp(x, torch.cat([wg, wu]), wdn, 4.0, 25.0)
    torch.testing.assert_close(fn(), ref, atol=2e-2, rtol=2e-2)
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_router_latent_fp32_logits_on_cuda():
    """k3::router_latent_sharded with router_fp32 at TP=1 on CUDA: fp32 logits equal to the model's
    x.float() @ W_r.float().T (the kernels decline the flag; the reference runs), the latent in bf16."""
    torch.manual_seed(0)
    x = torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16)
    wr = torch.randn(896, 7168, device="cuda", dtype=torch.bfloat16) / 85
    wd = torch.randn(3584, 7168, device="cuda", dtype=torch.bfloat16) / 85
    logits, lat = torch.ops.k3.router_latent_sharded(x, wr, wd, 0, 1, None, True)
    assert logits.dtype == torch.float32 and lat.dtype == torch.bfloat16
    torch.testing.assert_close(logits, x.float() @ wr.float().T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lat, x @ wd.T, atol=2e-2, rtol=2e-2)


def _tiny(dtype="bfloat16", layers=4):
    cfg = K3Config.tiny(dtype=dtype, num_layers=layers)
    return cfg, K3Model(cfg, device="cuda")


def test_reduce_overhead_uses_cuda_graphs_and_matches_eager_mode():
    from torch._dynamo.utils import counters
    cfg, m = _tiny()
    ids = [torch.randint(0, cfg.vocab, (4, 1), device="cuda", generator=torch.Generator("cuda").manual_seed(s))
           for s in range(4)]
    ce = m.new_cache(4)
    f_ref = torch.compile(m, backend=k3compile.backend(mode="eager"), fullgraph=True)
    ref = [f_ref(i, ce) for i in ids]
    torch._dynamo.reset()
    counters.clear()
    cc = m.new_cache(4)
    f = torch.compile(m, backend="k3", mode="reduce-overhead", fullgraph=True)
    out = [f(i, cc).clone() for i in ids]
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    rep = k3compile.last_report()
    assert all(p.matched == p.expected for p in rep.passes if not p.skipped), rep.render()
    # first step: kernel rounding only; later steps may flip near-tied experts in bf16
    assert (out[0] - ref[0]).abs().max() <= 5e-2 * ref[0].abs().max()
    torch.testing.assert_close(cc.seq_lens, ce.seq_lens)


def _kernel_intervals(prof) -> dict:
    import json
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        trace = json.load(open(fh.name))
    by_stream: dict = {}
    for e in trace["traceEvents"]:
        if e.get("cat") == "kernel":
            by_stream.setdefault(e["args"]["stream"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    return by_stream


def _is_gemm(name: str) -> bool:
    return any(t in name.lower() for t in ("gemm", "nvjet", "cutlass", "xmma"))


def _profile(fn):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return _kernel_intervals(prof)


def test_shared_expert_overlaps_routed_experts_on_two_streams():
    """1. Without CUDA graphs each kernel keeps the stream it was launched on: exactly two
    streams, and the side one holds the shared experts (two GEMMs per MoE layer) and nothing of
    the routed experts. (Without graphs the CPU launches kernel by kernel, so the GPU often waits
    for launches and overlap there proves little.)
    2. Under CUDA graphs (reduce-overhead) the replay runs both branches at once: the shared
    experts' GEMMs, recognised by the kernel names step 1 found only on the side stream, must
    spend most of their time overlapped by other kernels."""
    cfg = K3Config.tiny(dtype="bfloat16", num_layers=4, hidden=1024, shared_inter=8192, latent=512,
                        expert_inter=1024, num_experts=16, top_k=4)
    m = K3Model(cfg, device="cuda")
    ids = torch.zeros(64, 1, dtype=torch.long, device="cuda")
    cache = m.new_cache(64)
    f = torch.compile(m, backend="k3", fullgraph=True)
    for _ in range(3):
        f(ids, cache)
    by_stream = _profile(lambda: f(ids, cache))
    assert len(by_stream) == 2, f"expected the main and the side stream, got {sorted(by_stream)}"
    side_id = min(by_stream, key=lambda s: len(by_stream[s]))
    main_names = {n for s, ivs in by_stream.items() if s != side_id for *_, n in ivs}
    side_gemms = [n for *_, n in by_stream[side_id] if _is_gemm(n)]
    assert len(side_gemms) == 2 * len(cfg.moe_layers), [n for *_, n in by_stream[side_id]]
    only_side = set(side_gemms) - main_names
    assert only_side, f"the shared-expert GEMM kernels also run on the main stream: {set(side_gemms)}"

    torch._dynamo.reset()
    g = torch.compile(m, backend="k3", mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        g(ids, cache)
    kernels = [iv for ivs in _profile(lambda: g(ids, cache)).values() for iv in ivs]
    shared = [(a, b) for a, b, n in kernels if n in only_side]
    others = [(a, b) for a, b, n in kernels if n not in only_side]
    assert len(shared) == len([n for n in side_gemms if n in only_side]), (len(shared), only_side)
    union: list = []  # the other kernels' busy time as disjoint intervals
    for c, d in sorted(others):
        if union and c <= union[-1][1]:
            union[-1][1] = max(union[-1][1], d)
        else:
            union.append([c, d])
    overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in shared for c, d in union)
    busy = sum(b - a for a, b in shared)
    print(f"graphed: {len(shared)} shared-expert GEMMs, {busy:.1f} us, {overlap:.1f} us overlapped by other kernels")
    assert overlap > 0.5 * busy, (overlap, busy)


def test_kernels_match_reference_tp1():
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from _gpu_ranks import kernels_vs_reference
    res = kernels_vs_reference(0, 1)
    _check_kernel_results(res)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_kernels_match_reference_tp2_symmetric_memory():
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from _gpu_ranks import kernels_vs_reference
    from k3compile.distributed import run_ranks
    for res in run_ranks(kernels_vs_reference, 2):
        assert res["_symm"] and all(v.startswith("symmetric memory") for v in res["_symm"].values()), res["_symm"]
        _check_kernel_results(res)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_oproj_push_gemm_matches_reference_tp2():
    """The CuTe push-epilogue GEMM + flag-waiting all-reduce kernel (K3_KNOBS=cute_push=1) equals the
    o-proj reference at TP=2, eagerly, graphed, and over several calls replayed from one graph;
    every shape must have taken the push path (no fallback)."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from _gpu_ranks import oproj_push_vs_reference
    from k3compile.distributed import run_ranks
    for res in run_ranks(oproj_push_vs_reference, 2):
        print(res["_pushed"], res["_fallbacks"])
        assert not res["_fallbacks"], res["_fallbacks"]
        assert len(res["_pushed"]) == 2 * 4 + 2, res["_pushed"]   # K x M, and M=4 of the three-call graph
        _check_kernel_results(res)


def _check_kernel_results(res):
    """bf16 outputs: the kernels round like the references, so differences are a few bf16 steps
    relative to the output's largest value (NCCL sums in another order at TP>1)."""
    cases = {k: v for k, v in res.items() if not k.startswith("_")}
    print("\n".join(f"{k}: {v}" for k, v in cases.items()))
    assert cases
    bad = {k: v for k, v in cases.items() if not (v["err"] <= 1e-2 and v["err_graphed"] <= 1e-2)}
    assert not bad, bad


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("knobs", [{}, {"COMM_VEC": False, "COMM_EARLY": False}, {"COLS": False},
                                   {"COLS_MIN_WORLD": 1, "COLS_MAX_M": 4}])
def test_comm_kernels_match_reference_with_simulated_peers(world, knobs, monkeypatch):
    """The o-proj, layer-input and latent-tail ops' kernels on one GPU as rank 0 of a simulated group of 2 / 8
    (tests/simpeers.py: the peers' partials in ordinary buffers, their barrier signals set before;
    world 1: no peers), bf16, eager and replayed from a CUDA graph, with the communication kernels'
    options (comm: the vector signal/poll and the early reads, or the 45ff89b kernels' order; tuning: the
    column-split forms where comm.cols_plan takes them, at every group size up to 4 rows, or never)."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from _gpu_ranks import _graphed, rel
    import simpeers

    from k3compile.kernels import comm, tuning
    for k, v in knobs.items():
        monkeypatch.setattr(tuning if hasattr(tuning, k) else comm, k, v)
    errs = {}
    for M in (1, 4, 5, 16, 64):
        for nb in (0, 3):
            run, ref, _ = simpeers.oproj_case(world, M, nb, seed=M)
            errs[f"oproj M={M} blocks={nb}"] = [rel(a, b) for out in (run(), _graphed(run)) for a, b in zip(out, ref)]
        run, ref, _ = simpeers.tail_case(world, M, seed=M)
        errs[f"tail M={M}"] = [rel(out, ref) for out in (run(), _graphed(run))]
        run, ref, _ = simpeers.residual_norm_case(world, M, 3, seed=M)
        errs[f"residual_norm M={M}"] = [rel(a, b) for out in (run(), _graphed(run)) for a, b in zip(out, ref)]
    print("\n".join(f"{k}: {v}" for k, v in errs.items()))
    bad = {k: v for k, v in errs.items() if max(v) > 1e-2}
    assert not bad, bad


def test_column_split_kernels_replayed_many_times_keep_their_grid_barrier(monkeypatch):
    """The column-split kernels' grid barrier resets itself: one graph of 3 layer-input ops and a
    latent tail (world 1 and simulated world 8, M = 1) replayed 200 times gives the first replay's
    outputs every time, and nothing hangs."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from _gpu_ranks import rel
    from k3compile.kernels import comm, tuning
    import simpeers
    monkeypatch.setattr(tuning, "COLS_MIN_WORLD", 1)
    assert comm.cols_plan(1, 7168, 4, None) is not None
    for world in (1, 8):
        cases = [simpeers.residual_norm_case(world, 1, 3, seed=s) for s in range(3)]
        tail = simpeers.tail_case(world, 1, seed=5)

        def step():
            return [c[0]() for c in cases] + [tail[0]()]
        step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = step()
        g.replay()
        first = [[t.clone() for t in o] if isinstance(o, tuple) else o.clone() for o in outs]
        for _ in range(200):
            g.replay()
        torch.cuda.synchronize()
        for o, f, c in zip(outs[:3], first[:3], cases):
            assert all(torch.equal(a, b) for a, b in zip(o, f))
            assert max(rel(a, b) for a, b in zip(o, c[1])) <= 1e-2
        assert torch.equal(outs[3], first[3]) and rel(outs[3], tail[1]) <= 1e-2


@pytest.mark.parametrize("variant", ["v2b", "v3", "v3g", "v4g", "cute"])  # cute: v3 where no artifact (K3_CUTE_DIR)
def test_mxfp4_expert_kernels_match_reference_bf16_graphed(variant, monkeypatch):
    """The MXFP4 expert kernels through k3::mxfp4_experts (bf16, K3's per-rank TP=8 expert
    width) equal the model op's reference, eagerly and replayed from a CUDA graph; each variant
    (K3_KNOBS mxfp4, read at every call) - v3 is the only check of its bf16 MMA path (subnormal +-0.5
    operands included: random codes); 16 tokens on 32 experts share experts (v3g's tiles of
    several pairs)."""
    monkeypatch.setenv("K3_KNOBS", knobs_text(mxfp4=variant))
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from _gpu_ranks import _graphed
    from k3compile.kernels import dispatch
    from k3compile.model.moe_ops import mxfp4_experts_reference
    g = torch.Generator(device="cuda").manual_seed(0)
    E, I, L = 32, 384, 3584
    w13, s13, w2, s2 = random_experts(E, I, L, g, device="cuda")
    for M in (1, 5, 16):
        x = torch.randn(M, L, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.randint(0, E, (M, 16), generator=g, device="cuda", dtype=torch.int32)
        assert dispatch.pick("mxfp4_experts", "cuda", x, ids, w13, s13, w2, s2, 4.0, 25.0).name == "triton_mxfp4"
        ref = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0)
        for out in (torch.ops.k3.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0),
                    _graphed(torch.ops.k3.mxfp4_experts, x, ids, w13, s13, w2, s2, 4.0, 25.0)):
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            assert err <= 1e-2, (M, err)


@pytest.mark.parametrize("M", [1, 4, 16])
def test_shared_expert_situ_mlp_bf16_graphed(M):
    """The shared expert at TP=8 widths (7168 -> 2 x 768 -> 7168, bf16): GEMM, the SiTU kernel, GEMM,
    against model.functional.situ_mlp, eagerly, graphed, and on the side stream through the k3 ops."""
    from _gpu_ranks import _graphed, rel
    from k3compile.kernels import moe
    from k3compile.model.functional import situ_mlp
    g = torch.Generator("cuda").manual_seed(M)
    x = torch.randn(M, 7168, device="cuda", generator=g).bfloat16()
    wgu = (torch.randn(1536, 7168, device="cuda", generator=g) / 7168 ** 0.5 * 3).bfloat16()
    wdn = (torch.randn(7168, 768, device="cuda", generator=g) / 768 ** 0.5).bfloat16()
    ref = situ_mlp(x, wgu, wdn, 4.0, 25.0).float()
    for out in (moe.situ_mlp(x, wgu, wdn, 4.0, 25.0), _graphed(moe.situ_mlp, x, wgu, wdn, 4.0, 25.0),
                torch.ops.k3.stream_join(torch.ops.k3.shared_expert_async(x, wgu, wdn, 4.0, 25.0), x)):
        assert rel(out, ref) < 1e-2


@pytest.mark.parametrize("N, K", [(7168, 1536), (2240, 7168), (6284, 7168), (1536, 7168)])
def test_mma_gemm_matches_matmul_bf16_graphed_on_two_streams(N, K):
    """The tensor-core split-K decode GEMM at the layer's weight shapes, bf16, M = 1 / 5 / 16, in
    both MMA orientations, with and without a split, into a NaN-poisoned output (every element
    written); accumulating into a column slice (the latent tail's form); three split calls captured
    in one CUDA graph and replayed twice with new inputs; the same split config on the main and a
    side stream at once (their counters are separate); the counters zero after every launch."""
    from k3compile.kernels import gemm
    from k3compile.kernels.gemm import MmaCfg
    g = torch.Generator("cuda").manual_seed(N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    cfgs = [MmaCfg(32, 256, 1), MmaCfg(16, 256, 4), MmaCfg(64, 128, 8, stages=4, swap=True),
            MmaCfg(128, 128, 2, stages=3, swap=True)]

    def rel(out, ref):
        return ((out.float() - ref).abs().max() / ref.abs().max()).item()
    for M in (1, 5, 16):
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        ref = x.float() @ w.float().t()
        for cfg in cfgs:
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            assert rel(gemm.gemv(x, w, out=out, cfg=cfg), ref) < 1e-2, (M, cfg)
            wide = torch.randn(M, N + 64, device="cuda", generator=g).bfloat16()
            want = wide.float().clone()
            want[:, 32:32 + N] += ref
            gemm.gemv(x, w, out=wide[:, 32:32 + N], accumulate=True, cfg=cfg)
            assert rel(wide, want) < 1e-2, (M, cfg)
    assert gemm.split_counters(w.device).abs().max().item() == 0
    cfg = cfgs[1]
    xs = [torch.randn(4, K, device="cuda", generator=g).bfloat16() for _ in range(3)]
    outs = [torch.empty(4, N, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for x, o in zip(xs, outs):
        gemm.gemv(x, w, out=o, cfg=cfg)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, o in zip(xs, outs):
            gemm.gemv(x, w, out=o, cfg=cfg)
    for _ in range(2):
        for x in xs:
            x.copy_(torch.randn(4, K, device="cuda", generator=g).bfloat16())
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for x, o in zip(xs, outs):
            assert rel(o, x.float() @ w.float().t()) < 1e-2
    side = torch.cuda.Stream()
    x2 = torch.randn(16, K, device="cuda", generator=g).bfloat16()
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        a = gemm.gemv(xs[0], w, cfg=cfg)
        with torch.cuda.stream(side):
            b = gemm.gemv(x2, w, cfg=cfg)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert rel(a, xs[0].float() @ w.float().t()) < 1e-2 and rel(b, x2.float() @ w.float().t()) < 1e-2
    with torch.cuda.stream(side):
        side_cnt = gemm.split_counters(w.device)
    assert side_cnt.data_ptr() != gemm.split_counters(w.device).data_ptr()
    assert gemm._SPLIT[str(w.device)][0].abs().max().item() == 0   # every stream's counters


@pytest.mark.parametrize("N, K", [(7168, 1536), (2240, 7168), (3584, 3584), (7168, 768), (6284, 7168)])
def test_gemv_matches_matmul_bf16_graphed(N, K):
    """The Triton decode GEMV at the layer's weight shapes, bf16 (the CPU interpreter cannot check
    bf16 math faithfully), M = 1 / 4 / 8, each config of the sweep, eagerly; the default config
    graphed with new inputs; and the accumulate-into-columns form of the latent tail."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.gemv_bench import CONFIGS
    from k3compile.kernels import gemm
    g = torch.Generator("cuda").manual_seed(N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    for M in (1, 4, 8):
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        ref = x.float() @ w.float().t()
        for cfg in CONFIGS + [c + (1,) for c in CONFIGS]:   # and each in its LAZY form
            out = gemm.gemv(x, w, cfg=cfg)
            assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, (M, cfg)
        wide = torch.randn(M, N + 64, device="cuda", generator=g).bfloat16()
        want = wide.float().clone()
        want[:, 32:32 + N] += ref
        gemm.gemv(x, w, out=wide[:, 32:32 + N], accumulate=True)
        assert ((wide.float() - want).abs().max() / want.abs().max()).item() < 1e-2, M
    xs = torch.randn(4, K, device="cuda", generator=g).bfloat16()
    out = torch.empty(4, N, device="cuda", dtype=torch.bfloat16)
    gemm.gemv(xs, w, out=out)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm.gemv(xs, w, out=out)
    xs.copy_(torch.randn(4, K, device="cuda", generator=g).bfloat16())
    graph.replay()
    ref = xs.float() @ w.float().t()
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_gemv_two_weights_bf16_graphed():
    """mma_gemm2's CUDA-core form (gemv_kernel TWO) at the TP=1 router + latent shapes (896 + 3584 rows of
    7168), bf16, M = 1 / 4 / 8, into two column ranges of one buffer (nothing written outside), and
    replayed from a CUDA graph with new inputs."""
    from k3compile.kernels import gemm
    g = torch.Generator("cuda").manual_seed(11)
    wr = (torch.randn(896, 7168, device="cuda", generator=g) / 7168 ** 0.5).bfloat16()
    wd = (torch.randn(3584, 7168, device="cuda", generator=g) / 7168 ** 0.5).bfloat16()
    cfg = (4, 1024, 4, 3)
    for M in (1, 4, 8):
        x = torch.randn(M, 7168, device="cuda", generator=g).bfloat16()
        ref = torch.cat([x.float() @ wr.float().t(), x.float() @ wd.float().t()], 1)
        buf = torch.full((M, 4480 + 16), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm.mma_gemm2(x, wr, wd, cfg, out1=buf[:, 8:904], out2=buf[:, 904:4488])
        assert ((buf[:, 8:4488].float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, M
        assert buf[:, :8].isnan().all() and buf[:, 4488:].isnan().all()
    x = torch.randn(1, 7168, device="cuda", generator=g).bfloat16()
    o1, o2 = gemm.mma_gemm2(x, wr, wd, cfg)   # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm.mma_gemm2(x, wr, wd, cfg, out1=o1, out2=o2)
    x.copy_(torch.randn(1, 7168, device="cuda", generator=g).bfloat16())
    graph.replay()
    ref = torch.cat([x.float() @ wr.float().t(), x.float() @ wd.float().t()], 1)
    assert ((torch.cat([o1, o2], 1).float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


def _pdl_chain_bit_equal(monkeypatch, var, value, ms, inputs, chain, widths):
    """For each M: `chain(inputs, outs)` run eagerly and captured in a CUDA graph once with the knob `var` = "off"
    and once with `var` = `value` (read at launch: the PDL launches); the two give bit-equal outputs of the
    given widths eagerly, and after new inputs are copied in, replayed (three times, each output changed)."""
    for M in ms:
        t = inputs(M)
        outs = {k: [torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for n in widths] for k in ("off", "on")}
        graphs = {}
        for k in ("off", "on"):
            monkeypatch.setenv("K3_KNOBS", knobs_text(**{var: value if k == "on" else "off"}))
            chain(t, outs[k])   # eager (and compiled before the capture)
            torch.cuda.synchronize()
            graphs[k] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[k]):
                chain(t, outs[k])
            monkeypatch.setenv("K3_KNOBS", knobs_text(**{var: ""}))
        for a, b in zip(outs["off"], outs["on"]):
            assert torch.equal(a, b), (M, "eager")
        for _ in range(3):
            for src, dst in zip(inputs(M), t):
                dst.copy_(src)
            before = [o.clone() for o in outs["on"]]
            graphs["off"].replay()
            graphs["on"].replay()
            torch.cuda.synchronize()
            for a, b, old in zip(outs["off"], outs["on"], before):
                assert torch.equal(a, b), (M, "graphed")
                assert not torch.equal(b, old)


@pytest.mark.parametrize("between", [False, True], ids=["pair", "between"])
@pytest.mark.parametrize("pf", ["0", "16384", "65536"])
def test_gemv_pdl_after_norm_equals_plain_chain_graphed(monkeypatch, pf, between):
    """K3_KNOBS gemv_pdl: the TP=1 all-reduce / norm kernel called with trigger=True triggering its dependents at
    its start, then the CUDA-core GEMV called with after_trigger=True launched with PDL (its weight rows' first
    `pf` bytes requested into L2 before the wait): plain, lazy and stacked (TWO) forms, M = 1 / 2, eagerly and
    replayed from a CUDA graph with new inputs, bit-equal to the same chain launched without PDL (the same sums in
    the same order; only the launch differs), and the GEMV reads the norm's fresh output (a stale read would
    differ after the inputs change). `between`: another kernel sits between the two and rewrites the GEMV's input
    in place (x * 2): the GEMV, whose grid-dependency wait comes before it reads x, still reads that kernel's
    output, not the norm's."""
    from k3compile.kernels import comm, gemm
    g = torch.Generator("cuda").manual_seed(5)
    H, bf = 7168, torch.bfloat16
    w = (torch.randn(3648, H, device="cuda", generator=g) / H ** 0.5).to(bf)
    wr = (torch.randn(896, H, device="cuda", generator=g) / H ** 0.5).to(bf)
    gw, wn = torch.rand(H, device="cuda", generator=g).to(bf) + 0.5, torch.rand(H, device="cuda", generator=g).to(bf)
    wq = (torch.randn(H, device="cuda", generator=g) * 0.05).to(bf)

    def inputs(M):
        return [torch.randn(M, H, device="cuda", generator=g).to(bf) for _ in range(5)]

    def norm(t):
        local, res, *blocks = t
        _, x = comm.ar_residual_norm(local, None, res, gw, wn, wq, blocks, 1e-6, trigger=True)
        if between:
            x.mul_(2)
        return x

    def chain(t, outs):   # each GEMV form as the secondary of its own norm (pair_pdl's arguments)
        gemm.gemv(norm(t), w, out=outs[0], cfg=(4, 1024, 4, 3), after_trigger=True)
        gemm.gemv(norm(t), w, out=outs[1], cfg=(4, 1024, 4, 3, 1), after_trigger=True)
        gemm.mma_gemm2(norm(t), wr, w, (2, 1024, 4, 4, 1), out1=outs[2], out2=outs[3], after_trigger=True)

    _pdl_chain_bit_equal(monkeypatch, "gemv_pdl", pf, (1, 2), inputs, chain, (3648, 3648, 896, 3648))


@pytest.mark.parametrize("pf", ["0", "16384"])
def test_compiled_model_with_pdl_pairs_equals_it_without(monkeypatch, pf):
    """The tiny model at TP=1 (hidden 512: K >= the default GEMV's BLOCK_K), compiled by k3 with Inductor, every
    decode GEMM on the CUDA-core GEMV (K3_KNOBS gemv=1): pair_pdl pairs every norm op with the GEMM after it, and
    with gemv_pdl=<pf> those GEMVs launch as PDL secondaries of the triggering norm kernels; four decode steps give
    the same logits bit for bit as the same compile with gemv_pdl=off."""
    cfg = K3Config.tiny(dtype="bfloat16", num_layers=4, hidden=512)
    m = K3Model(cfg, device="cuda")
    ids = [torch.randint(0, cfg.vocab, (1, 1), device="cuda", generator=torch.Generator("cuda").manual_seed(s))
           for s in range(4)]
    out = {}
    for v in ("off", pf):
        monkeypatch.setenv("K3_KNOBS", knobs_text(gemv="1", gemv_pdl=v))
        torch._dynamo.reset()
        f = torch.compile(m, backend="k3", fullgraph=True)
        cache = m.new_cache(1)
        out[v] = [f(i, cache).clone() for i in ids]
        rep = k3compile.last_report().get("pair_pdl")
        assert rep.matched == rep.expected == 2 * cfg.num_layers, rep
    for a, b in zip(out["off"], out[pf]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("M", [1, 4, 16])
def test_kda_conv_decode_kernel_matches_reference_bf16_graphed(M):
    """k3::kda_conv_decode's CUDA path (kernels/triton_conv.py) at TP=8 KDA widths (12 heads of 128, width
    4), bf16, q / k / v read as column slices of one projection output: eagerly against the op's
    reference (one bf16 ulp of the conv sum apart at most: 2e-2), then captured in a CUDA graph and
    replayed with new inputs and state; then the in-place op (k3::kda_conv_decode_) eagerly."""
    from k3compile.kernels import dispatch
    from k3compile.ops import reference as ref
    cq, kw = 12 * 128, 4
    g = torch.Generator("cuda").manual_seed(M)
    proj = torch.randn(M, 3 * cq + 1548, device="cuda", generator=g).bfloat16()
    state = torch.randn(M, 3 * cq, kw - 1, device="cuda", generator=g).bfloat16()
    w = (torch.randn(3 * cq, kw, device="cuda", generator=g) / 2).bfloat16()
    args = (proj[:, :cq], proj[:, cq:2 * cq], proj[:, 2 * cq:3 * cq], state, w)
    k = dispatch.pick("kda_conv_decode", "cuda", *args)
    assert k is not None and k.name == "triton_short_conv"

    def check(got):
        want = ref.kda_conv_decode(*args)
        for a, b in zip(got, want):
            assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < 2e-2
        assert torch.equal(got[3], want[3])
    check(k.fn(*args))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = k.fn(*args)
    for _ in range(2):
        proj.copy_(torch.randn(proj.shape, device="cuda", generator=g).bfloat16())
        state.copy_(torch.randn(state.shape, device="cuda", generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        check(outs)
    # in place (k3::kda_conv_decode_, what fold_kda_conv emits): the state itself gets the new state
    ki = dispatch.pick("kda_conv_decode_", "cuda", *args)
    assert ki is not None and ki.name == "triton_short_conv"
    want = ref.kda_conv_decode(*args)
    got = ki.fn(*args)
    torch.cuda.synchronize()
    assert torch.equal(state, want[3])
    for a, b in zip(got, want[:3]):
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < 2e-2


@pytest.mark.parametrize("M, H", [(1, 12), (4, 12), (2, 48)])
def test_mla_decode_kernel_matches_reference_bf16_graphed(M, H):
    """The Triton MLA decode (kernels/model_ops.mla_decode, the op's CUDA kernel unless K3_KNOBS=mla_triton=0)
    at K3's latent widths (L 512, rope 64), bf16, a 1032-slot cache with NaN past each row's end:
    eagerly against the op's reference (2e-2 relative: bf16 and the softmax weights rounded to bf16),
    then captured in a CUDA graph and replayed with new queries and lengths, the cache written at each
    row's new position."""
    from k3compile.kernels import model_ops
    from k3compile.model import attention_ops as A
    L, R, S = 512, 64, 1032
    g = torch.Generator("cuda").manual_seed(M * 100 + H)

    def draw():
        ql = torch.randn(M, H, L, device="cuda", generator=g).bfloat16()
        qr = torch.randn(M, H, R, device="cuda", generator=g).bfloat16()
        return ql, qr, torch.randn(M, L + R, device="cuda", generator=g).bfloat16()

    cache = torch.randn(M, S, L + R, device="cuda", generator=g).bfloat16()
    lens = torch.tensor([1024, 7, 300, 1031][:M] if M <= 4 else [5] * M, device="cuda")
    for m in range(M):
        cache[m, int(lens[m]) + 1:] = float("nan")
    ql, qr, kv_new = draw()
    c1, c2 = cache.clone(), cache.clone()
    ref = A.mla_decode_reference(ql, qr, kv_new, c1, lens, L ** -0.5)
    got = model_ops.mla_decode(ql, qr, kv_new, c2, lens, L ** -0.5)
    assert not got.isnan().any()
    assert ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 2e-2
    assert torch.equal(c1.nan_to_num(7.0), c2.nan_to_num(7.0))
    # graphed: new queries and lengths, one position further
    out = torch.empty_like(got)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(model_ops.mla_decode(ql, qr, kv_new, c2, lens, L ** -0.5))
    lens += 1   # the capture recorded the write and the kernels; the replay runs them on these values
    lens.clamp_(max=S - 1)
    new = draw()
    for t, v in zip((ql, qr, kv_new), new):
        t.copy_(v)
    c1 = c2.clone()
    graph.replay()
    ref = A.mla_decode_reference(ql, qr, kv_new, c1, lens, L ** -0.5)
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 2e-2
    assert torch.equal(c1.nan_to_num(7.0), c2.nan_to_num(7.0))


@pytest.mark.parametrize("M", [1, 4, 16])
def test_head_bmm_matches_bmm_bf16_graphed(M):
    """k3::decode_bmm's Triton kernel in bf16 at the MLA layer's TP=8 shapes (absorption: W_uk [12,
    128, 512]; value up-projection: W_uv [12, 128, 512] used transposed, with the output gate), x a
    permuted view as the graph hands it, eagerly and replayed in a CUDA graph with new inputs,
    against torch.bmm (* sigmoid(gate))."""
    g = torch.Generator("cuda").manual_seed(M)
    for K, N, w_nk in ((128, 512, False), (512, 128, True)):
        w = (torch.randn(*((12, N, K) if w_nk else (12, K, N)), device="cuda", generator=g) / K ** 0.5).bfloat16()
        xs = torch.randn(M, 12, K, device="cuda", generator=g).bfloat16()
        x = xs.permute(1, 0, 2)
        gate = torch.randn(M, 12, N, device="cuda", generator=g).bfloat16() if w_nk else None  # the output gate

        def ref():
            r = torch.bmm(x.float(), (w.transpose(1, 2) if w_nk else w).float())
            return r * torch.sigmoid(gate.float()).permute(1, 0, 2) if w_nk else r
        out = torch.ops.k3.decode_bmm(x, w, w_nk, gate)
        assert ((out.float() - ref()).abs().max() / ref().abs().max()).item() < 1e-2, (K, N)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.k3.decode_bmm(x, w, w_nk, gate)
        xs.copy_(torch.randn(M, 12, K, device="cuda", generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert ((out.float() - ref()).abs().max() / ref().abs().max()).item() < 1e-2, (K, N, "graphed")
