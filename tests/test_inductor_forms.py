"""The K3 passes on the graphs Inductor's own passes hand them on a GPU, reproduced on CPU.

`backend="k3"` runs the passes in Inductor's post-grad custom slot, after Inductor's joint-graph and
post-grad pattern passes; k3's eager mode (the other CPU tests) runs them on the AOT graph alone. The
backend of tests/_inductor_forms.py runs those Inductor passes first, taking their device-dependent
rewrites as for CUDA tensors, then the rewritten graph op by op (the k3 ops' CPU references). The
forms that reach the passes only there (issue 52: the H100 compile of the fused-style decoder at M=1):
- a batch-1 bmm as `mm(a.squeeze(0), b.squeeze(0)).unsqueeze(0)` (joint_graph.bmm_to_mm, GPU only):
  the MoE finalize's einsum / bmm at M=1;
- `mm + add` folded into `addmm(add_operand, x, W)` (post_grad's `addmm` pattern, every device; on a
  GPU not where every user of the add is pointwise): a layer's o-proj GEMM and its residual add, where
  the residual also goes to a non-pointwise op (the AttnRes block buffer, an in-place prefix).
Tolerance: none. The rewrites keep every rounding the eager model makes, so the compiled logits equal
eager's bit for bit (as tests/test_others_k3.py in k3's eager mode).
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import k3compile  # noqa: E402
from k3compile.options import K3Options  # noqa: E402
from k3compile.passes.canonicalize import canonicalize, is_inductor_addmm  # noqa: E402
from k3compile.passes.lower_decode_gemm import LowerDecodeGemm  # noqa: E402
from k3compile.passes.manager import PassManager, snapshot  # noqa: E402
from tests import _inductor_forms as IF  # noqa: E402
from tests.others import mixed as MX  # noqa: E402
from tests.others import run as R  # noqa: E402
from tests.others.run import EXPECTED, LAYERS, MOE  # noqa: E402

aten = torch.ops.aten


def _input_graphs():
    """An observer for the PassManager that keeps a copy of the graph as the passes receive it."""
    seen = []

    def observe(stage, name, graph):
        if stage == "input":
            seen.append(snapshot(graph))
    return seen, observe


def _batch1_bmms(graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target is aten.bmm.default
               and n.args[0].meta["val"].shape[0] == 1)


@pytest.mark.parametrize("gpu", [False, True])
def test_harness_gives_the_gpu_finalize_form(gpu):
    """The harness itself: an M=1 finalize `einsum("mk,mkd->md")` reaches the passes as a bmm of batch 1
    on CPU, as squeeze -> mm -> unsqueeze with the GPU rewrites (what the H100 compile showed)."""
    seen, observe = _input_graphs()

    def f(w, y):
        return torch.einsum("mk,mkd->md", w, y)

    torch.compile(f, backend=IF.backend(gpu=gpu, observer=observe))(torch.rand(1, 4), torch.randn(1, 4, 8))
    (g,) = seen
    mms = [n for n in g.nodes if n.op == "call_function" and n.target is aten.mm.default]
    assert (_batch1_bmms(g), len(mms)) == ((0, 1) if gpu else (1, 0)), g


def _check(what, eager, compiled, rep, M, gemms_left=0):
    """Every expected site of the role-anchored passes matched (4 attention / 3 MoE layers), every GEMM
    left lowered but `gemms_left`, and the logits equal eager's bit for bit."""
    st = rep["structure"]
    assert (st["attention_layers"], st["moe_layers"], st["m"]) == (LAYERS, MOE, M), (what, st)
    by = {p["name"]: p for p in rep["passes"]}
    for name, n in {**EXPECTED, "lower_decode_gemm": by["lower_decode_gemm"]["expected"]}.items():
        p = by[name]
        left = gemms_left if name == "lower_decode_gemm" else 0
        assert (p["matched"] + left, p["expected"]) == (n, n) and n, (
            what, name, p["matched"], p["expected"], p["skipped"], [nm["reason"] for nm in p["near_misses"][:3]])
    assert torch.equal(compiled, eager), f"{what}: max abs err {(compiled - eager).abs().max().item():.4g}"


FOLDS = {"hf_style": True, "functional": False, "fused": True}


def _run_style(style, M):
    seen, observe = _input_graphs()
    eager, compiled, rep = R.run(style, world=1, M=M, backend=IF.backend(gpu=True, observer=observe), steps=2,
                                 report=True)
    # the harness gave the GPU forms: no batch-1 bmm left; Inductor's addmm folds where a residual add
    # also goes to a non-pointwise op (hf_style's and fused's AttnRes block writes, fused's in-place prefix)
    assert _batch1_bmms(seen[-1]) == 0, "the harness left a batch-1 bmm: not the GPU form"
    assert any(is_inductor_addmm(n) for n in seen[-1].nodes) == FOLDS[style], style
    return eager, compiled, rep


@pytest.mark.parametrize("style", R.STYLES)
def test_every_site_matches_gpu_forms(style):
    """The three independent decoders at M=1, TP=1 with the graphs a GPU compile gives: the MoE finalize
    after bmm -> mm (the H100 near-miss "routed output is not followed by one weighted RMSNorm"), the
    o-proj GEMM folded with its residual add into addmm (the H100 near-miss "addmm ...: not lowered",
    and the residual stream hidden from the roles: o-proj and layer-input sites not found at all)."""
    _check(style, *_run_style(style, 1), M=1)


@pytest.mark.slow
@pytest.mark.parametrize("style", R.STYLES)
def test_every_site_matches_gpu_forms_m3(style):
    _check(style, *_run_style(style, 3), M=3)


def test_inductor_addmm_unfolded_model_addmm_kept():
    """canonicalize turns back only the addmm Inductor folded out of `mm + add` (its node keeps the add's
    original_aten); an addmm the model wrote stays, and the lowering names it."""
    seen, observe = _input_graphs()

    def f(x, w, c, blocks):
        folded = torch.mm(x, w.t()) + c        # the sum also goes to a non-pointwise op: folded, any device
        blocks[0].copy_(folded)
        return folded, torch.addmm(c, x, w.t())

    # widths over 16: Inductor's CPU decomposition makes an addmm of M=1 and N, K <= 16 pointwise
    x, w, c = torch.randn(1, 32).bfloat16(), torch.randn(32, 32).bfloat16(), torch.randn(1, 32).bfloat16()
    torch.compile(f, backend=IF.backend(gpu=True, observer=observe))(x, w, c, torch.zeros(2, 1, 32).bfloat16())
    g = seen[-1]
    addmms = [n for n in g.nodes if n.op == "call_function" and n.target is aten.addmm.default]
    assert sorted(is_inductor_addmm(n) for n in addmms) == [False, True], g
    assert canonicalize(g) == 1
    left = [n for n in g.nodes if n.op == "call_function" and n.target is aten.addmm.default]
    assert len(left) == 1 and not is_inductor_addmm(left[0])
    mm = [n for n in g.nodes if n.op == "call_function" and n.target is aten.mm.default]
    assert len(mm) == 1 and [u.target for u in mm[0].users] == [aten.add.Tensor], g
    why = LowerDecodeGemm.match(left[0], K3Options.make())
    assert "addmm written by the model" in why.reason


def _norm(h, g):
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype) * g


def test_folds_that_hide_every_residual_add_are_undone():
    """Two layers whose o-proj GEMM Inductor folds into the residual add (each sum also written to a
    block buffer), no router: nothing is found before canonicalising, two attention layers after; the
    rewritten graph's output is eager's."""
    seen, observe = _input_graphs()

    def f(x, w1, w2, g1, g2, buf):
        h = x
        for i, (w, g) in enumerate(((w1, g1), (w2, g2))):
            h = h + torch.mm(_norm(h, g), w.t())
            buf[i].copy_(h)
        return _norm(h, g2)

    H = 32
    args = (torch.randn(1, H).bfloat16(), torch.randn(H, H).bfloat16(), torch.randn(H, H).bfloat16(),
            torch.randn(H).bfloat16(), torch.randn(H).bfloat16(), torch.zeros(2, 1, H).bfloat16())
    out = torch.compile(f, backend=IF.backend(gpu=True, observer=observe))(*[a.clone() for a in args])
    assert sum(is_inductor_addmm(n) for n in seen[-1].nodes) == 2
    st = k3compile.last_report().structure
    assert (st["attention_layers"], st["residual_adds"]) == (2, 2), st
    assert torch.equal(out, f(*args))


def test_graph_without_k3_structure_keeps_inductors_addmm():
    """A graph in which nothing is found, canonicalised or not (a GEMM plus a bias: no residual add), is
    left as Inductor gave it, its addmm included."""
    seen, observe = _input_graphs()

    def f(x, w, b, buf):
        y = torch.mm(x, w.t()) + b
        buf[0].copy_(y)
        return y.relu()

    torch.compile(f, backend=IF.backend(gpu=True, observer=observe))(
        torch.randn(4, 32).bfloat16(), torch.randn(32, 32).bfloat16(), torch.randn(32).bfloat16(),
        torch.zeros(2, 4, 32).bfloat16())
    g = seen[-1]
    before = [n.target for n in g.nodes]
    assert before.count(aten.addmm.default) == 1
    PassManager(K3Options.make())(g)
    assert [n.target for n in g.nodes] == before
    assert not k3compile.last_report().is_k3


@pytest.mark.parametrize("gpu", [False, True])
def test_attnres_logits_gemv_is_no_decode_gemm_site(gpu):
    """The AttnRes logits `einsum("smh,h->sm", keys, w_qk)`: a bmm of batch 1 on CPU, `mm(keys, w_qk
    viewed [H, 1])` on a GPU (bmm_to_mm). Neither is a decode GEMM (a vector parameter, fp32): not
    counted as a lower_decode_gemm site on either (the H100 report of the fused decoder's layer cut at
    M=16, where the mixer stays unfused, had two "weight stored [in, out]" near-misses from it)."""
    from k3compile.passes.lower_decode_gemm import _has_weight
    seen, observe = _input_graphs()

    def logits(src, w_qk):   # the keys: computed from the sources (a normalisation in the model)
        keys = src.float() * torch.rsqrt(src.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return torch.einsum("smh,h->sm", keys, w_qk.float())

    torch.compile(logits, backend=IF.backend(gpu=gpu, observer=observe))(torch.randn(2, 16, 64).bfloat16(),
                                                                         torch.randn(64).bfloat16())
    (g,) = seen
    gemms = [n for n in g.nodes if n.op == "call_function" and n.target in (aten.mm.default, aten.bmm.default)]
    assert [n.target for n in gemms] == [aten.mm.default if gpu else aten.bmm.default], g
    assert not _has_weight(gemms[0])


def test_fused_rms_norm_decomposition_matches():
    """On CUDA, F.rms_norm reaches aten._fused_rms_norm (CUDA kernel; CompositeImplicitAutograd elsewhere,
    native_functions.yaml), which AOT decomposes with torch._decomp's `_fused_rms_norm`: eps through
    add.Scalar, the bf16 weight multiplied into the fp32 result, type_as. Every norm of the mixed
    decoder in that form, through the GPU forms: every site matches, the logits are eager's. (The form
    matched before this test was written: its graph is the CPU composite's (rms_norm_composite) but for
    eps, the double 1e-05 where the composite's C++ rounds it to float, 9.999999747378752e-06.)"""
    sps = [dict(MX.DEFAULT, norm="fused_rms_norm", keys=k) for k in ("weighted", "rounded", "fp32", "weighted")]
    eager, compiled, rep = MX.run(sps, world=1, M=1, backend=IF.backend(gpu=True), steps=2)
    _check("fused_rms_norm", eager, compiled, rep, M=1)
