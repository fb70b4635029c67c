"""fold_norm_gemv: an RMSNorm read only by a decode GEMM folded into k3::decode_gemm_normed.

- CPU: the pass fires on a norm feeding a lowered GEMM and the compiled function equals eager
  exactly; a norm without weight or read twice is a near-miss with its reason, and stays correct.
  (The tiny model's site count, every MLA q_a norm and the first layer's input norm, at TP 1 / 2:
  test_compiler.py.)
- The kernels in Triton's CPU interpreter (fp32, fp16): the CUDA-core GEMV with the norm folded in
  (strided x, ragged K, M = 1 and 3) and the norm kernel, against the op's reference; on CUDA
  (GPU suite) the op at the MLA q_b shape in bf16, M = 1 (the GEMV) and 4 (norm kernel + cuBLAS),
  eagerly and graphed.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import k3compile
import k3compile.ops  # noqa: F401  (registers k3::)
from k3compile.model.functional import rms_norm
from k3compile.ops import reference as ref


def _step(variant):
    def fn(x, g, w, attn):
        h = rms_norm(x, None if variant == "no weight" else g, 1e-6)
        y = torch.nn.functional.linear(h, w)
        # an attention core beside it: a graph without one has no K3 structure and gets no pass
        o = torch.ops.k3model.mla_decode(*attn, 0.25)
        return (y + h[:, :1] if variant == "read twice" else y), o
    return fn


@pytest.mark.parametrize("variant, why", [
    ("model", None),
    ("no weight", "no weight of x's width"),
    ("read twice", "read a norm that other nodes read too"),   # no site: a note, not a near-miss
])
def test_fold_norm_gemv_matches_or_says_why(variant, why):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 48, generator=gen).bfloat16()
    g = (torch.rand(48, generator=gen) + 0.5).bfloat16()
    w = torch.randn(40, 48, generator=gen).bfloat16()
    attn = [torch.randn(2, 2, 16, generator=gen).bfloat16(), torch.randn(2, 2, 16, generator=gen).bfloat16(),
            torch.randn(2, 32, generator=gen).bfloat16(), torch.randn(2, 8, 32, generator=gen).bfloat16(),
            torch.tensor([3, 5])]
    want = _step(variant)(x, g, w, [a.clone() for a in attn])
    torch._dynamo.reset()
    k3compile.clear_reports()
    fn = torch.compile(_step(variant), fullgraph=True, dynamic=False,
                       backend=k3compile.backend(mode="eager", passes=["lower_decode_gemm", "fold_norm_gemv"]))
    got = fn(x, g, w, attn)
    p = k3compile.last_report().get("fold_norm_gemv")
    assert p.error is None and p.skipped is None and p.expected == (0 if variant == "read twice" else 1)
    if why is None:
        assert p.matched == 1 and not p.near_misses
    elif variant == "read twice":
        assert p.matched == 0 and not p.near_misses and any(why in n for n in p.notes), p.notes
    else:
        assert p.matched == 0 and len(p.near_misses) == 1 and why in p.near_misses[0].reason, p.near_misses
    torch.testing.assert_close(got, want, rtol=0, atol=0)


_TRITON_CPU = """
import os, torch
os.environ["TRITON_INTERPRET"] = "1"
from k3compile.kernels import launch
from k3compile.ops import reference as ref
out = []
g = torch.Generator().manual_seed(1)
for dt in (torch.float32, torch.float16):
    for M, K, N, cfg in ((1, 1536, 40, (2, 1024, 4, 1)), (3, 200, 33, (8, 64, 4, 1)), (2, 200, 33, (8, 64, 4, 1, 1))):
        xs = (torch.randn(M, K + 24, generator=g) * 3).to(dt)[:, 8:8 + K]     # rows strided, as a split gives
        gw = (torch.rand(K, generator=g) + 0.5).to(dt)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dt)
        want = ref.decode_gemm_normed(xs, gw, 1e-6, w).float()
        got = launch.gemv(xs, w, cfg=cfg, norm=(gw, 1e-6)).float()
        nrm = launch.rms_norm(xs, gw, 1e-6).float()
        out.append((str(dt), M, ((got - want).abs().max() / want.abs().max()).item(),
                    ((nrm - ref.rms_norm(xs, gw, 1e-6).float()).abs().max()).item()))
print(out)
"""


def test_norm_in_gemv_and_norm_kernel_match_reference_in_the_interpreter():
    """launch.gemv(norm=) and launch.rms_norm equal rms_norm(x) @ W.T and rms_norm(x): fp32 to 1e-5,
    fp16 to 2e-3 relative (the reference rounds the normed x to fp16, the GEMV does not); the norm
    alone within one fp16 rounding step (fp32: 1e-5)."""
    r = subprocess.run([sys.executable, "-c", _TRITON_CPU], env=dict(os.environ), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own subprocess's list
    assert len(rows) == 6, rows
    for dt, M, err, nerr in rows:
        assert err < (1e-5 if "float32" in dt else 2e-3), (dt, M, err)
        assert nerr < (1e-5 if "float32" in dt else 1e-2), (dt, M, nerr)


def test_norm_gemv_refuses_what_it_cannot_do():
    x, w = torch.randn(1, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match="norm"):
        from k3compile.kernels import launch
        launch.gemv(x, w, cfg=(2, 64, 4, 1), norm=(torch.ones(32), 1e-6))
    with pytest.raises(ValueError, match="no PDL or norm"):
        launch.gemv(x, w, cfg=launch.MmaCfg(16, 64, 1), norm=(torch.ones(64), 1e-6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 4])
def test_decode_gemm_normed_on_cuda_bf16_eager_and_graphed(M):
    """The MLA q_b at TP=8 widths (1536 -> 2304, bf16): at M=1 the table's CUDA-core GEMV with the
    norm inside, at M=4 the norm kernel then cuBLAS; against the reference (1e-2 relative), eagerly
    and replayed from a CUDA graph with new inputs."""
    from k3compile.kernels import choose
    gen = torch.Generator("cuda").manual_seed(M)
    xs = (torch.randn(M, 3648, device="cuda", generator=gen) * 3).bfloat16()[:, :1536]
    gw = (torch.rand(1536, device="cuda", generator=gen) + 0.5).bfloat16()
    w = (torch.randn(2304, 1536, device="cuda", generator=gen) / 1536 ** 0.5).bfloat16()
    assert isinstance(choose.gemv_plan(xs, w), tuple) == (M == 1)   # the path under test

    def err(out):
        want = ref.decode_gemm_normed(xs, gw, 1e-6, w).float()
        return ((out.float() - want).abs().max() / want.abs().max()).item()

    assert err(torch.ops.k3.decode_gemm_normed(xs, gw, 1e-6, w)) < 1e-2
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.k3.decode_gemm_normed(xs, gw, 1e-6, w)
    xs.copy_((torch.randn(M, 1536, device="cuda", generator=gen) * 2).bfloat16())
    graph.replay()
    assert err(out) < 1e-2
