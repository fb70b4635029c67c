"""GPU test of the AOT-built CuTe kernels (`pytest -m gpu tests/test_gpu_cute.py`, run on an H100/H200).

Needs the artifacts built on a CPU machine (`python -m k3compile.kernels.cute.build --out DIR`,
copied to the GPU machine, `K3_CUTE_DIR=DIR`); the DSL is NOT needed here. For every artifact and
M in {1, 5, m_max}: the kernel launched by the driver-only loader equals torch.mm in fp32 on
random bf16 data (bound: 1e-2 of the output's largest value, bf16 output rounding), eagerly and
replayed from a CUDA graph with new input values copied into the captured buffers; rows past M are
untouched (a guard row after the output). MXFP4 experts (gate-up + SiTU, down): the artifacts vs
the model op's reference, eager and CUDA-graphed, and moe.mxfp4_experts(variant="cute") with no
fallback. Never run yet: written on a machine without a GPU.
JIT path (needs the DSL importable on the GPU machine, else skipped; not yet run on a GPU): with
an empty K3_CUTE_DIR, moe.mxfp4_experts through dispatch builds the MXFP4 artifacts on first
use (build.ensure), runs them without fallback, eagerly and replayed from a CUDA graph.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from k3compile.config import knobs_text
import torch
from _mxfp4_data import random_experts  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _artifacts():
    from k3compile.kernels.cute.build import default_dir
    d = Path(os.environ.get("K3_CUTE_DIR") or default_dir())
    return sorted(d.glob("skinny_gemm_bf16_*.json"))   # the push GEMMs: test_gpu.py's push test


def test_artifacts_present():
    assert _artifacts(), "no CuTe artifacts: build them with python -m k3compile.kernels.cute.build and set K3_CUTE_DIR"


@pytest.mark.parametrize("mf", _artifacts() or [None], ids=lambda p: p.stem if p else "none")
def test_skinny_gemm_matches_torch_eager_and_graphed(mf):
    if mf is None:
        pytest.skip("no artifacts")
    from k3compile.kernels.cute.loader import Artifact
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a cubin")
    art = Artifact(mf)
    N, K, mmax = art.man["shapes"]["n"], art.man["shapes"]["k"], art.man["m_max"]
    g = torch.Generator("cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    for M in sorted({1, 5, mmax} & set(range(1, mmax + 1))):
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        buf = torch.full((M + 1, N), 7.0, device="cuda", dtype=torch.bfloat16)
        out = buf[:M]
        art.launch_gemm(x, w, out)
        torch.cuda.synchronize()
        ref = x.float() @ w.float().t()
        err = (out.float() - ref).abs().max().item()
        assert err <= 1e-2 * ref.abs().max().item(), (mf.stem, M, err)
        assert (buf[M] == 7.0).all(), "wrote past row M"
        # CUDA graph: capture once, replay with new inputs copied into the captured buffers
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            art.launch_gemm(x, w, out)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            art.launch_gemm(x, w, out)
        x.copy_(torch.randn(M, K, device="cuda", generator=g).bfloat16())
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref = x.float() @ w.float().t()
        err = (out.float() - ref).abs().max().item()
        print(f"{mf.stem} M={M}: graphed max err {err:.3e} (ref max {ref.abs().max().item():.3e})")
        assert err <= 1e-2 * ref.abs().max().item(), (mf.stem, M, "graphed", err)


def test_dispatch_uses_cute_when_forced(monkeypatch):
    arts = _artifacts()
    if not arts or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("no artifacts / not sm_90")
    from k3compile.kernels import gemm
    from k3compile.kernels.cute import artifacts
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute="1"))
    x = torch.randn(4, 1536, device="cuda").bfloat16()
    w = (torch.randn(7168, 1536, device="cuda") / 40).bfloat16()
    artifacts._WHY.clear()
    y = gemm.gemm("oproj", x, w)
    assert not artifacts.fallbacks(), artifacts.fallbacks()
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- MXFP4 routed experts (mxfp4_experts.py)

def _mxfp4_pairs(math="f32"):
    """(I, (gate_up, down)) of the artifacts of `math`: "f32", "f16x2" or "f16x2_TAG" (an alternate
    of build.MXFP4_ALT, built with --alt)."""
    from k3compile.kernels.cute import loader
    from k3compile.kernels.cute.build import default_dir
    d = Path(os.environ.get("K3_CUTE_DIR") or default_dir())
    math, _, tag = math.partition("_")
    found = []
    for I in (384, 1536):
        arts, _ = loader.find_mxfp4(d, I, 3584, 16, math, tag)
        if arts is not None:
            found.append((I, arts))
    return found


# max |err| / max |ref|: f32 math only rounds the bf16 output; f16x2 sums each 32-code block in
# fp16 and rounds mid to fp16 (CPU emulation: 6e-3 on small shapes), the bound v3 has in experts_bench
MXFP4_TOL = {"f32": 1e-2, "f16x2": 2e-2, "f16x2_xf": 2e-2, "f16x2_m32": 2e-2, "f16x2_dn2x": 2e-2,
             "f16x2_sh": 2e-2, "f16x2_ldg": 2e-2, "f16x2_ldgd": 2e-2}   # "_TAG": build.MXFP4_TAGS (not the probes: wrong results by design)


def test_mxfp4_artifacts_present():
    assert _mxfp4_pairs(), "no CuTe MXFP4 artifacts: python -m k3compile.kernels.cute.build, K3_CUTE_DIR"


def _graphed_with_new_inputs(fn, x, ids, E, g):
    """fn() captured in a CUDA graph (after a warm-up call on a side stream), then replayed with new
    random x and expert ids copied into the captured buffers; returns the graph's output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    (M, L), K = x.shape, ids.shape[1]
    x.copy_(torch.randn(M, L, generator=g, device="cuda").to(torch.bfloat16))
    ids.copy_(torch.randint(0, E, (M, K), generator=g, device="cuda", dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("math", sorted(MXFP4_TOL))
@pytest.mark.parametrize("I", [384, 1536])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_mxfp4_experts_match_reference_eager_and_graphed(I, math, pdl):
    """The gate-up (SiTU fused) + down artifacts through the driver-only loader vs the model op's
    reference (bf16 x, random codes incl. +-0.5 subnormal operands, scales 2^-9 .. 2^-4), eagerly
    and replayed from a CUDA graph with new x and ids copied into the captured buffers; down
    launched plainly and with Programmatic Dependent Launch."""
    pairs = dict(_mxfp4_pairs(math))
    tol = MXFP4_TOL[math]
    if I not in pairs or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("no artifact for this I (alternates: build --alt) / not sm_90")
    from k3compile.kernels.cute import loader
    from k3compile.model.moe_ops import mxfp4_experts_reference
    gu, dn = pairs[I]
    g = torch.Generator(device="cuda").manual_seed(0)
    E, L, K = (32 if I == 384 else 8), 3584, 16
    w13, s13, w2, s2 = random_experts(E, I, L, g, device="cuda")
    for M in (1, 5, 16):
        x = torch.randn(M, L, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.randint(0, E, (M, K), generator=g, device="cuda", dtype=torch.int32)
        out = loader.mxfp4_experts(gu, dn, x, ids, w13, s13, w2, s2, 4.0, 25.0, pdl=pdl)
        torch.cuda.synchronize()
        ref = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0).float()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        print(f"mxfp4 cute {math} pdl={pdl} I={I} M={M}: eager err {err:.3e}")
        assert out.shape == (M, K, L) and out.dtype == torch.bfloat16
        assert err <= tol, (I, M, err)
        # CUDA graph: capture once, replay with new inputs copied into the captured buffers
        gout = _graphed_with_new_inputs(lambda: loader.mxfp4_experts(gu, dn, x, ids, w13, s13, w2, s2, 4.0, 25.0,
                                                                     pdl=pdl), x, ids, E, g)
        ref = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0).float()
        err = ((gout.float() - ref).abs().max() / ref.abs().max()).item()
        print(f"mxfp4 cute {math} pdl={pdl} I={I} M={M}: graphed err {err:.3e}")
        assert err <= tol, (I, M, "graphed", err)


def test_mxfp4_dispatch_runs_cute_without_fallback(monkeypatch):
    """moe.mxfp4_experts with each CuTe variant at 1 and 17 tokens (the default f16x2 dispatch takes
    the register-staged "ldgd" kernels at TP=8 widths up to 16 tokens, moe.mxfp4_tag, the untagged
    ones above), against the reference, with no fallback."""
    if not _mxfp4_pairs() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("no MXFP4 artifacts / not sm_90")
    from k3compile.kernels import moe
    from k3compile.kernels.cute import artifacts
    from k3compile.model.moe_ops import mxfp4_experts_reference
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_mxfp4_tag=""))
    g = torch.Generator(device="cuda").manual_seed(1)
    E, I, L = 16, 384, 3584
    w13, s13, w2, s2 = random_experts(E, I, L, g, device="cuda")
    for M in (1, 17):
        x = torch.randn(M, L, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.randint(0, E, (M, 16), generator=g, device="cuda", dtype=torch.int32)
        ref = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0).float()
        for variant, math in (("cute", "f32"), ("cute_h2", "f16x2")):
            if not _mxfp4_pairs(math):
                continue
            monkeypatch.setattr(artifacts, "_WHY", {})
            out = moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0, variant=variant)
            assert not artifacts.fallbacks(), artifacts.fallbacks()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            assert err <= MXFP4_TOL[math], (variant, M, err)
    assert {k[-1] for k in artifacts._FOUND if k[-2] == "f16x2"} >= {"ldgd", ""}, list(artifacts._FOUND)


def test_mxfp4_dispatch_builds_artifacts_just_in_time(monkeypatch, tmp_path):
    """Empty K3_CUTE_DIR, DSL importable: the first dispatch call of each math (the default
    variant, cute_h2, and cute) compiles its gate-up + down variants into the directory
    (build.ensure, once each), the kernels equal the model op's reference at M = 1 and 4 (TP=8
    shapes), eagerly and replayed from a CUDA graph, with no fallback and no compile after the
    first call (none inside the capture)."""
    from k3compile.kernels.cute import dsl_available
    if not dsl_available():
        pytest.skip("the CuTe DSL is not importable (the JIT path needs it)")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a cubins")
    from k3compile.kernels import moe
    from k3compile.kernels.cute import artifacts
    from k3compile.kernels.cute import build
    from k3compile.model.moe_ops import mxfp4_experts_reference
    d = tmp_path / "jit"
    monkeypatch.setenv("K3_CUTE_DIR", str(d))
    monkeypatch.delenv("K3_KNOBS", raising=False)
    monkeypatch.setattr(artifacts, "_FOUND", {})
    monkeypatch.setattr(artifacts, "_WHY", {})
    calls, real = [], build.compile_variant
    monkeypatch.setattr(build, "compile_variant", lambda v, out: calls.append(v["name"]) or real(v, out))
    g = torch.Generator(device="cuda").manual_seed(2)
    E, I, L, K = 32, 384, 3584, 16
    w13, s13, w2, s2 = random_experts(E, I, L, g, device="cuda")
    for variant, math in ((None, "f16x2"), ("cute", "f32")):
        for M in (1, 4):
            # f16x2 at M = 1, 4: the tagged kernels moe.mxfp4_tag picks ("ldgd" at I=384)
            tag = moe.mxfp4_tag(I, M) if math == "f16x2" else ""
            want = sorted(v["name"] for v in build.jit_variants("mxfp4", I, L, K, math, tag))
            x = torch.randn(M, L, generator=g, device="cuda").to(torch.bfloat16)
            ids = torch.randint(0, E, (M, K), generator=g, device="cuda", dtype=torch.int32)
            if variant is None:
                assert moe.mxfp4_variant(None, x, I, M) == "cute_h2"
            out = moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0, variant=variant)
            torch.cuda.synchronize()
            assert not artifacts.fallbacks(), artifacts.fallbacks()
            assert len(want) == 2 and all((d / f"{n}.cubin").exists() for n in want) and set(calls) >= set(want)
            ref = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0).float()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            print(f"mxfp4 JIT {math} M={M}: eager err {err:.3e}")
            assert out.shape == (M, K, L) and err <= MXFP4_TOL[math], (math, M, err)
            n_calls = len(calls)
            gout = _graphed_with_new_inputs(lambda: moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0,
                                                                         variant=variant), x, ids, E, g)
            ref = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0).float()
            err = ((gout.float() - ref).abs().max() / ref.abs().max()).item()
            print(f"mxfp4 JIT {math} M={M}: graphed err {err:.3e}")
            assert err <= MXFP4_TOL[math], (math, M, "graphed", err)
            assert len(calls) == n_calls and not artifacts.fallbacks(), (calls, artifacts.fallbacks())
    assert len(calls) == len(set(calls)) == 5, calls   # f16x2: xf gate-up, down, gate-up; f32: two; each once
