"""fold_kda_step: the KDA short conv folded into the decode step's recurrence kernel.

Matches, once per KDA layer at decode (anchored on each auto-functionalized k3::kda_decode_fb, which
fold_kda_fb emits), the conv op feeding it:
    q, k, v, new_conv_state = auto_functionalized(k3::kda_conv_decode_, Xq, Xk, Xv, w, state=conv_state)
    o, new_state = auto_functionalized(k3::kda_decode_fb, q=view(q), k=view(k), v=view(v), Fa, W_fb, B,
                                       A_log, dt_bias, ..., state=state)
with the conv's q, k, v read by those views alone and the views by the core alone (fold_kda_conv's
and fold_kda_fb's outputs; v1 or v2 functionalization, both nodes alike).
Emits one auto_functionalized node on both states:
    o, new_conv_state, new_state = k3::kda_step_decode_(Xq, Xk, Xv, w, Fa, W_fb, B, A_log, dt_bias,
                                                         conv_state, state, lower, scale, eps, qk_dtype)
whose CUDA path is one Triton kernel (kernels/triton_kda.py): per (token, head) P programs each
convolve the head's q and k channels and their own value channels, then run fold_kda_fb's gate and
recurrence; the last of a head's programs to arrive (a counter) shifts the q / k conv state, so none
reads a shifted window. Three launches (the conv, cuBLAS's f_b GEMV, fla's recurrence) become one.
Its reference is kda_conv_decode_'s, then kda_decode_fb's: exact on CPU.
Near-misses: the core is not fold_kda_fb's (that pass did not apply: disabled, gated off or a
near-miss), its q, k, v are not one kda_conv_decode_'s outputs, or those are read elsewhere too.
Expected: one site per KDA decode core. Skipped: model dtype / TP size not supported, static M
outside the pass's batch range; on CUDA with Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py) (M = 1..16:
2.7 us per KDA layer step at M=4 on an H200, a tie at M=1; at 16 slower alone, 2.5 us faster with
fold_kda_onorm, which needs it).
"""
from __future__ import annotations

import operator

import torch

from ..ops import OPS
from ..patterns.graph import Fail, is_call, strip
from ..patterns.structure import op_name
from .base import K3Pass
from .pipeline import register
from .common import emit_functionalized, getitem, kda_decode_cores, last_of

_CORE = "k3::kda_decode_fb"
_CONV = "k3::kda_conv_decode_"
_HOPS = (torch.ops.higher_order.auto_functionalized, getattr(torch.ops.higher_order, "auto_functionalized_v2", None))


def _base(n, name: str):
    """The graph input an auto-functionalized node mutates as its argument `name` (v2: a base)."""
    kw = n.kwargs
    if f"_{name}_base_index" in kw:
        return kw["_all_bases"][kw[f"_{name}_base_index"]]
    return kw.get(name)


def _outputs(n) -> dict:
    """{index: getitem node} of a multi-output node (None where one index is read twice)."""
    out = {}
    for u in n.users:
        if not is_call(u, operator.getitem) or u.args[1] in out:
            return None
        out[u.args[1]] = u
    return out


@register
class FoldKdaStep(K3Pass):
    name = "fold_kda_step"
    core = "KDA"   # rewrites the reference model's KDA attention-core op: skipped (with a reason) without it
    description = "KDA short conv + the f_b-folded recurrence -> k3::kda_step_decode_ (one kernel for the step)"
    pattern = "kda_decode_fb(view(q), view(k), view(v), ...) with q, k, v = kda_conv_decode_(...) (per KDA decode layer)"
    emits = "k3::kda_step_decode_, auto-functionalized on the conv state and the state"

    def expected(self, info):
        return len(kda_decode_cores(info.attention))   # one per KDA decode layer

    def run(self, graph, info, opts, report):
        cores = kda_decode_cores(graph.nodes)
        report.expected = len(cores)
        for core, conv, outs in self.collect(cores, self.match, report):
            kw = core.kwargs
            args = dict(xq=conv.kwargs["xq"], xk=conv.kwargs["xk"], xv=conv.kwargs["xv"], w=conv.kwargs["w"],
                        **{k: kw[k] for k in ("fa", "f_b", "beta", "a_log", "dt_bias", "lower", "scale", "eps",
                                              "qk_dtype")})
            bases = dict(conv_state=_base(conv, "state"), state=_base(core, "state"))
            v2 = core.target is not torch.ops.higher_order.auto_functionalized
            new = emit_functionalized(graph, last_of(graph, [*args.values(), *bases.values()]),
                                      OPS["kda_step_decode_"], args, bases, v2=v2)
            for i, old in ((0, outs["core"].get(0)), (1, outs["conv"].get(3)), (2, outs["core"].get(1))):
                if old is not None:
                    old.replace_all_uses_with(getitem(graph, new, i))
            report.matched += 1

    @staticmethod
    def match(core):
        if op_name(core) != _CORE:
            return Fail(core, f"the KDA decode core is {op_name(core)}, not fold_kda_fb's {_CORE}: that pass did "
                              "not apply here (disabled, gated off or a near-miss there)")
        parts = []
        for i, key in enumerate(("q", "k", "v")):
            g = strip(core.kwargs.get(key))
            if not (is_call(g, operator.getitem) and g.args[1] == i and op_name(g.args[0]) == _CONV
                    and g.args[0].target in _HOPS):
                return Fail(core, f"the core's {key} is not output {i} of fold_kda_conv's {_CONV}")
            parts.append(g)
        conv = parts[0].args[0]
        if any(p.args[0] is not conv for p in parts):
            return Fail(core, "the core's q, k and v come from different conv ops")
        if (conv.target is torch.ops.higher_order.auto_functionalized) != (core.target is torch.ops.higher_order.auto_functionalized):
            return Fail(core, "the conv and the core are functionalized in different forms (v1 / v2)")
        for key, p in zip("qkv", parts):
            n, chain = core.kwargs[key], []
            while n is not p:
                chain.append(n)
                n = n.args[0]
            if any(len(c.users) != 1 for c in (*chain, p)):
                return Fail(p, f"the conv's {key} output is read elsewhere too: folding would compute the conv twice")
        oc, ok = _outputs(conv), _outputs(core)
        if oc is None or ok is None or set(oc) - {0, 1, 2, 3} or set(ok) - {0, 1}:
            return Fail(core, "the conv's or the core's outputs are not read through one getitem each")
        return core, conv, dict(conv=oc, core=ok)
