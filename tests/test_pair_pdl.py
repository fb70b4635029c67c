"""pair_pdl: the TP=1 norm op and the decode GEMM reading its output get `trigger` / `after_trigger`, and nothing else."""
from __future__ import annotations

import operator

import pytest
import torch

import k3compile
from k3compile.model import K3Config, K3Model
from k3compile.ops import OPS
from k3compile.options import K3Options
from k3compile.passes.manager import PASSES
from k3compile.passes.pair_pdl import next_launch, normed_readers
from k3compile.patterns.opcall import OpCall
from k3compile.patterns.structure import GraphInfo
from k3compile.report import PassReport

k3 = torch.ops.k3
NORMS = (k3.residual_norm.default, k3.oproj_allreduce_residual.default)
GEMMS = (k3.decode_gemm.default, k3.router_latent_sharded.default)


def _compiled_graph(num_layers=4, M=2, **opts):
    """The final graph of the tiny reference model at TP=1 (k3's eager mode), and the step's output against eager."""
    from k3compile.compiler import _compile
    from k3compile.passes.manager import PassManager
    cfg = K3Config.tiny(dtype="bfloat16", num_layers=num_layers)
    m = K3Model(cfg)
    o = K3Options.make(mode="eager", **opts)
    seen = {}

    def be(gm, ex):
        return _compile(gm, ex, o, manager=PassManager(o, observer=lambda st, p, g: seen.update(g=g)))
    ids = torch.zeros(M, 1, dtype=torch.long)
    torch._dynamo.reset()
    out = torch.compile(m, backend=be, fullgraph=True)(ids, m.new_cache(M))
    return cfg, seen["g"], out, m(ids, m.new_cache(M))


def test_every_tp1_norm_is_paired_with_the_gemm_reading_its_output():
    """In the reference model at TP=1 every norm op (each layer's post-attention norm, each later layer's input
    norm and the final norm: two per layer) triggers, and the GEMM op launched right after it, which reads its
    normed output (the dense MLP's gate-up, the stacked router + latent, the KDA in_proj / MLA qkv_a, the LM
    head through a view), is its PDL secondary; no other GEMM op is (the first layer's in_proj after Inductor's
    norm, the MLA q_b, the MLP down). The step stays exact (the references ignore both arguments)."""
    cfg, g, out, ref = _compiled_graph()
    assert torch.equal(out, ref)
    nodes = list(g.nodes)
    norms = [n for n in nodes if n.target in NORMS]
    gemms = [n for n in nodes if n.target in GEMMS]
    assert len(norms) == 2 * cfg.num_layers
    assert all(OpCall(n).arg("trigger") is True for n in norms), [n.kwargs for n in norms]
    paired = [next_launch(n) for n in norms]
    for n, p in zip(norms, paired):
        assert p in normed_readers(n) and OpCall(p).arg("after_trigger") is True, (n, p)
    assert {p.target for p in paired} == set(GEMMS)   # a decode GEMM and the router + latent both
    others = [n for n in gemms if n not in paired]
    assert others and not any(OpCall(n).arg("after_trigger") for n in others), others
    # the LM head reads the final norm's output through views (no copy)
    head = paired[-1]
    assert OpCall(head).arg("x").target is not operator.getitem
    rep = k3compile.last_report().get("pair_pdl")
    assert rep.matched == rep.expected == 2 * cfg.num_layers, rep
    assert "norm -> GEMM pair(s)" in " ".join(rep.notes)


def test_without_lower_decode_gemm_nothing_is_paired():
    """pair_pdl needs lower_decode_gemm's ops (its row's `needs`): without it the pass is skipped with that reason
    and no norm triggers."""
    _, g, out, ref = _compiled_graph(num_layers=2, skip=["lower_decode_gemm", "fold_mla_output"])
    assert torch.equal(out, ref)
    assert not any(OpCall(n).arg("trigger") for n in g.nodes if n.target in NORMS)
    assert "needs lower_decode_gemm" in k3compile.last_report().get("pair_pdl").skipped


def _graph(kind: str):
    """A norm op and decode GEMMs by hand: `kind` says what reads the norm's output."""
    g = torch.fx.Graph()
    delta, res, gw, other, w, w2 = (g.placeholder(n) for n in ("delta", "res", "g", "other", "w", "w2"))
    group = "tp" if kind == "tp2" else None
    norm = g.call_function(OPS["residual_norm"], (delta, res, [], None, None, gw, 1e-6, group, []))
    upd = g.call_function(operator.getitem, (norm, 0))
    nrm = g.call_function(operator.getitem, (norm, 1))
    outs = [upd]
    if kind == "between":      # another GEMM op runs first, then the one reading the normed output
        outs.append(g.call_function(OPS["decode_gemm"], (other, w)))
    if kind != "other":
        x = g.call_function(torch.ops.aten.view.default, (nrm, [-1, 8])) if kind == "view" else nrm
        outs.append(g.call_function(OPS["decode_gemm"], (x, w2)))
    else:                      # the next GEMM reads another tensor; the normed output is read by no GEMM op
        outs.append(g.call_function(OPS["decode_gemm"], (other, w)))
        outs.append(g.call_function(torch.ops.aten.relu.default, (nrm,)))
    g.output(tuple(outs))
    return g, norm


@pytest.mark.parametrize("kind, pairs", [("direct", 1), ("view", 1), ("other", 0), ("between", 0), ("tp2", 0)])
def test_pairs_only_the_next_gemm_that_reads_the_normed_output(kind, pairs):
    """The norm triggers, and the GEMM is its PDL secondary, only where the GEMM op launched right after the norm
    reads its normed output (itself or a view of it), at TP=1. A GEMM of another input after it is not paired (the
    norm then does not trigger either); another GEMM op between the two is a near-miss, not counted; a norm op
    of a TP group (TP > 1) is no site, and a note says why."""
    g, norm = _graph(kind)
    rep = PassReport("pair_pdl")
    PASSES["pair_pdl"].run(g, GraphInfo(tp=2 if kind == "tp2" else 1, m=1), K3Options.make(), rep)
    gemms = [n for n in g.nodes if n.target in GEMMS]
    assert rep.matched == rep.expected == pairs, rep
    assert bool(OpCall(norm).arg("trigger")) is bool(pairs)
    assert [bool(OpCall(n).arg("after_trigger")) for n in gemms] == [bool(pairs)] * pairs + [False] * (len(gemms) - pairs)
    notes = " ".join(rep.notes)
    if kind == "between":
        assert len(rep.near_misses) == 1 and "k3::decode_gemm runs between the norm and the GEMM" in \
            rep.near_misses[0].reason, rep.near_misses
    elif kind == "tp2":
        assert "no norm op in its TP=1 form (TP=2)" in notes, notes
    elif kind == "other":
        assert "whose output no decode GEMM op reads" in notes, notes
    else:
        assert not rep.near_misses and "1 norm -> GEMM pair(s)" in notes


def test_references_ignore_the_pair_arguments():
    """The arguments are launch hints: the ops' results on CPU are the same with and without them."""
    gen = torch.Generator().manual_seed(0)
    x, w, res, gw = (torch.randn(*s, generator=gen) for s in ((2, 16), (8, 16), (2, 16), (16,)))
    assert torch.equal(k3.decode_gemm(x, w, True), k3.decode_gemm(x, w))
    a = k3.residual_norm(x, res, [], None, None, gw, 1e-6, None, [], trigger=True)
    b = k3.residual_norm(x, res, [], None, None, gw, 1e-6, None, [])
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    a = k3.router_latent_sharded(x, w, w[:4], 0, 1, None, False, True)
    b = k3.router_latent_sharded(x, w, w[:4], 0, 1, None)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
