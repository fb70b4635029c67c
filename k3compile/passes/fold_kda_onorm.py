"""fold_kda_onorm: the KDA output norm folded into the decode step's kernel (k3::kda_step_decode_).

Matches, once per KDA layer at decode (anchored on each auto-functionalized k3::kda_step_decode_,
which fold_kda_step emits), the model's output norm of the step's o (layers.KDA.forward, spec
section 2 "per-head RMSNorm(o) * sigmoid(g)"):
    o, new_conv_state, new_state = auto_functionalized(k3::kda_step_decode_, ...)
    y = mul(rms_norm(o, W_o, eps), sigmoid(view(G, [M, H, V])))
with rms_norm the model's (patterns.graph.match_rms_norm: fp32, x * rsqrt(mean(x^2) + eps), times the
[V] weight, cast back; an fp32 graph has no casts, so x^2 and the product read o itself), o read by
the norm alone, the norm and the sigmoid by the mul alone, G [M, H * V] in the model dtype (the input
projection's g slice).
Emits: the same node with o_norm=W_o, gate=G, o_eps=eps added, its o now y (the mul's readers read
it; the norm's nodes go). On CUDA the step kernel's last program per head (the one that already
shifts the head's q / k conv state) reads the head's V outputs back and writes them normed and gated:
the Inductor norm kernel and its launch go (1.2 us and about 1 us of gaps at M=1, TP=8 widths, an
H200, kernel timeline). Reference: kda_step_decode_'s, then model.functional.rms_norm and the
sigmoid product: exact on CPU.
Near-misses: the core is not fold_kda_step's (that pass did not apply), o (or a node between o and
the norm's output) is read by more than the norm, the norm has no [V] weight, the gate is not
sigmoid(view(G)) of a [M, H * V] tensor, or the dtypes differ.
Expected: one site per KDA decode core. Skipped: model dtype / TP size not supported, static M
outside the pass's batch range; on CUDA with Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py) (M = 1..16:
0.8 / 1.8 us faster per KDA layer step at M = 1 / 4 on an H200, 2.5 at 16 with fold_kda_step, which
the gate lets through to 16 for it).
"""
from __future__ import annotations

import operator

import torch

from ..patterns.graph import Fail, aten, dtype, is_call, match_rms_norm, norm_rounding_text, shape
from ..patterns.structure import op_name
from .base import K3Pass
from .pipeline import register
from .common import KDA_DECODE_CORES, kda_decode_cores, retarget_functionalized

_CORE = "k3::kda_step_decode_"


def _sigmoid_gate(n):
    """(the [M, H * V] tensor G) when n is sigmoid(view(G, ...)), else None."""
    if not is_call(n, aten.sigmoid.default):
        return None
    v = n.args[0]
    if not is_call(v, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return None
    return v.args[0]


def _between(src, dst, order) -> set:
    """The nodes on a path from src to dst (both left out)."""
    up, stack = set(), [dst]
    while stack:   # dst's inputs back to src's position in the graph
        for a in stack.pop().all_input_nodes:
            if a not in up and a is not src and order.get(a, -1) > order[src]:
                up.add(a)
                stack.append(a)
    down, stack = set(), [src]
    while stack:   # src's readers that lead to dst
        for u in stack.pop().users:
            if u in up and u not in down:
                down.add(u)
                stack.append(u)
    return down


@register
class FoldKdaOnorm(K3Pass):
    name = "fold_kda_onorm"
    core = "KDA"   # rewrites the reference model's KDA attention-core op: skipped (with a reason) without it
    description = "KDA output norm (per-head RMSNorm(o) * sigmoid(g)) -> into k3::kda_step_decode_'s kernel"
    pattern = "mul(rms_norm(o, W_o), sigmoid(view(g))) with o = kda_step_decode_(...)[0] (per KDA decode layer)"
    emits = "k3::kda_step_decode_ with o_norm, gate, o_eps (its o normed and gated)"

    def expected(self, info):
        return len(kda_decode_cores(info.attention))   # one per KDA decode layer

    def run(self, graph, info, opts, report):
        cores = [n for n in graph.nodes if op_name(n) in (*KDA_DECODE_CORES, _CORE)]
        report.expected = len(cores)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for core, o, mul, site, gate in self.collect(cores, lambda c: self.match(c, order), report):
            kw = dict(core.kwargs, o_norm=site.weight, gate=gate, o_eps=float(site.eps))
            retarget_functionalized(core, core.args[0], kw)
            mul.replace_all_uses_with(o)
            report.matched += 1

    @staticmethod
    def match(core, order):
        if op_name(core) != _CORE:
            return Fail(core, f"the KDA decode core is {op_name(core)}, not fold_kda_step's {_CORE}: that pass did "
                              "not apply here (disabled, gated off or a near-miss there)")
        if core.kwargs.get("o_norm") is not None:
            return Fail(core, "the step already has its output norm")
        outs = [u for u in core.users if is_call(u, operator.getitem) and u.args[1] == 0]
        if len(outs) != 1:
            return Fail(core, "the step's o is not read through one getitem")
        o = outs[0]
        # the product with the gate: the first mul downstream of o (a few nodes: the norm's chain) with an
        # operand that is an RMSNorm of o
        found, seen, front = None, set(), [o]
        for _ in range(10):
            front = [u for n in front for u in n.users if u not in seen]
            seen.update(front)
            for u in front:
                if is_call(u, aten.mul.Tensor) and found is None:
                    for normed, sig in (u.args, u.args[::-1]):
                        site = match_rms_norm(normed) if isinstance(normed, torch.fx.Node) else None
                        if (site is not None and not isinstance(site, Fail) and site.x is o and site.out is normed
                                and is_call(sig, aten.sigmoid.default)):
                            found = u, normed, sig, site
                            break
            if found or not front:
                break
        if found is None:
            return Fail(o, "o is not read by rms_norm(o, w) * sigmoid(...)")
        mul, normed, sig, site = found
        if site.rounding:
            return Fail(normed, f"the output norm rounds in another order ({norm_rounding_text(site.rounding)}) than "
                                "k3::kda_step_decode_'s (x * rsqrt in fp32, the weight applied in fp32)")
        # o's new value is the product: nothing but the norm may read o or a node between o and the norm's
        # output (in bf16 / fp16 o's one reader is the cast to fp32; in fp32 there is no cast, and x^2 and
        # x * rsqrt(...) read o itself)
        inside = _between(o, normed, order)
        outside = [u for n in (o, *inside) for u in n.users if u not in inside and u is not normed]
        if outside:
            return Fail(o, f"the step's o has readers outside its output norm ({', '.join(u.name for u in outside)}): "
                           "the norm alone may read it")
        gate = _sigmoid_gate(sig)
        if gate is None:
            return Fail(mul, "the norm's factor is not sigmoid(view(g))")
        M, H, V = shape(o)
        if site.weight is None or shape(site.weight) != (V,):
            return Fail(normed, f"the output norm has no [{V}] weight")
        if shape(gate) != (M, H * V):
            return Fail(sig, f"the gate is {shape(gate)}, not [M, H * V] = {(M, H * V)}")
        if len({dtype(o), dtype(site.weight), dtype(gate), dtype(sig), dtype(mul), dtype(normed)}) != 1:
            return Fail(mul, "the norm's input, weight, gate and product are not all in one dtype")
        if len(sig.users) != 1 or len(sig.args[0].users) != 1 or len(normed.users) != 1:
            return Fail(mul, "the gate's sigmoid or the normed o is read elsewhere too")
        if any(isinstance(t, torch.fx.Node) and order.get(t, -1) > order[core] for t in (site.weight, gate)):
            return Fail(core, "the norm's weight or gate is computed after the step")
        return core, o, mul, site, gate

