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

from tests import _inductor_forms as IF  # noqa: E402
from tests.others import run as R  # noqa: E402
from tests.others.run import MOE  # noqa: E402

aten = torch.ops.aten


def _input_graphs():
    """An observer for the PassManager that keeps the graph as the passes receive it (readable)."""
    seen = []

    def observe(stage, name, graph):
        if stage == "input":
            seen.append(graph)
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


@pytest.mark.parametrize("style", R.STYLES)
def test_finalize_matches_the_gpu_mm_form(style):
    """fold_moe_finalize at M=1 with the finalize's bmm made an mm (the H100 near-miss "routed output is
    not followed by one weighted RMSNorm": the views after the mm hid the finalized output's cast)."""
    seen, observe = _input_graphs()
    eager, compiled, rep = R.run(style, world=1, M=1, backend=IF.backend(gpu=True, observer=observe), steps=2,
                                 report=True)
    assert _batch1_bmms(seen[-1]) == 0, "the harness left a batch-1 bmm: not the GPU form"
    p = {q["name"]: q for q in rep["passes"]}["fold_moe_finalize"]
    assert (p["matched"], p["expected"]) == (MOE, MOE), (style, [nm["reason"] for nm in p["near_misses"]])
    assert torch.equal(compiled, eager), f"{style}: max abs err {(compiled - eager).abs().max().item():.4g}"
