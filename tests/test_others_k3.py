"""The k3 backend on K3 decoders it was not written against (tests/others: written from the spec
alone, in three styles): every expected site of the passes that apply to such graphs matches, the
expected counts come from the graph's own structure (4 layers: KDA dense, KDA MoE, MLA MoE, KDA MoE),
and the compiled logits equal eager's.

The backend runs in its eager mode (the rewritten graph op by op, the k3 ops' PyTorch references on
CPU), so the comparison checks the rewrites' math: bit for bit. The rewrites keep every value's dtype
and the fused ops round as each model's norms and AttnRes mixers do (the order the patterns record),
and none of these styles has experts that a pass recomputes (their experts are an opaque op, or read
a value table passed in), so the compiled logits are eager's exactly, at TP=1 and at TP=2 on gloo.
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.others import run as R  # noqa: E402

from tests.others.run import EXPECTED, LAYERS, MOE  # noqa: E402


def _tol(ref):
    return 2e-2 * ref.abs().max().item() + 1e-2


def check(style, eager, compiled, rep, world, M):
    assert rep is not None, "no k3 report: the backend did not run"
    st = rep["structure"]
    assert (st["attention_layers"], st["moe_layers"], st["tp"], st["m"]) == (LAYERS, MOE, world, M), st
    by = {p["name"]: p for p in rep["passes"]}
    for name, n in EXPECTED.items():
        p = by[name]
        nms = [(nm["site"], nm["reason"]) for nm in p["near_misses"]]
        assert (p["matched"], p["expected"]) == (n, n), (style, world, M, name, p["matched"], p["expected"],
                                                         p["skipped"], p["error"], nms[:3])
    # the routed experts: an opaque op of the model's own (hf_style, fused) or a dequantisation reading a
    # value table passed in (functional): not lowered, each MoE a near-miss with that reason
    p = by["lower_mxfp4_experts"]
    why = {"hf_style": "opaque op", "fused": "opaque op", "functional": "values are not known when compiling"}[style]
    assert (p["matched"], p["expected"]) == (0, MOE) and len(p["near_misses"]) == MOE, (style, p)
    assert all(why in nm["reason"] for nm in p["near_misses"]), (style, p["near_misses"])
    err = (compiled - eager).abs().max().item()
    assert torch.equal(compiled, eager), f"{style} TP={world} M={M}: compiled differs from eager (max abs err {err:.4g})"
    assert err <= _tol(eager), f"{style} TP={world} M={M}: max abs err {err:.4g} > {_tol(eager):.4g}"


@pytest.mark.parametrize("style", R.STYLES)
@pytest.mark.parametrize("M", [1, 3])
def test_every_site_matches_tp1(style, M):
    eager, compiled, rep = R.run(style, world=1, M=M, backend="k3-eager", steps=2, report=True)
    check(style, eager, compiled, rep, 1, M)


@pytest.mark.slow
@pytest.mark.parametrize("style", R.STYLES)
def test_every_site_matches_tp1_m8(style):
    eager, compiled, rep = R.run(style, world=1, M=8, backend="k3-eager", steps=2, report=True)
    check(style, eager, compiled, rep, 1, 8)


@pytest.mark.parametrize("style", R.STYLES)
def test_every_site_matches_tp2(style):
    """Two gloo ranks, M = 1, 3 and 8 in one launch; rank 0's report and logits."""
    ms = (1, 3, 8)
    out = R.launch_many([dict(style=style, M=M, backend="k3-eager", steps=2, report=True) for M in ms], world=2)
    for M, (eager, compiled, rep) in zip(ms, out):
        check(style, eager, compiled, rep, 2, M)
