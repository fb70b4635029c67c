"""GPU test of the AOT-built CuTe kernels (`pytest -m gpu tests/test_gpu_cute.py`, run on an H100/H200).

Needs the artifacts built on a CPU machine (`python -m k3compile.kernels.cute.build --out DIR`,
copied to the GPU machine, `K3_CUTE_DIR=DIR`); the DSL is NOT needed here. For every artifact and
M in {1, 5, m_max}: the kernel launched by the driver-only loader equals torch.mm in fp32 on
random bf16 data (bound: 1e-2 of the output's largest value, bf16 output rounding), eagerly and
replayed from a CUDA graph with new input values copied into the captured buffers; rows past M are
untouched (a guard row after the output). Never run yet: written on a machine without a GPU.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _artifacts():
    from k3compile.kernels.cute.build import default_dir
    d = Path(os.environ.get("K3_CUTE_DIR") or default_dir())
    return sorted(d.glob("skinny_gemm_*.json"))


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
    from k3compile.kernels import choose
    monkeypatch.setenv("K3_CUTE", "1")
    x = torch.randn(4, 1536, device="cuda").bfloat16()
    w = (torch.randn(7168, 1536, device="cuda") / 40).bfloat16()
    choose._WHY.clear()
    y = choose.gemm("oproj", x, w)
    assert not choose.fallbacks(), choose.fallbacks()
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), atol=2e-2, rtol=2e-2)
