"""fuse_oproj_allreduce: attention o-proj GEMM + all-reduce + residual add (+ post-norm) -> one op.

Matches, once per decoder layer (anchored on the layer's o-proj GEMM, found by role: the GEMM
whose output, through its all-reduce, is the residual stream's attention delta, patterns.roles;
where a graph has no role-found layers, the first GEMM after each known attention core op):
    y = all_reduce(o @ W_o.T)            # mm / addmm / matmul forms; no all-reduce at TP=1
    updated = prefix + y                 # or Inductor's addmm(prefix, o, W_o.T) at TP=1
    normed = RMSNorm(updated) * g        # or the AttnRes mixer over [blocks..., updated] (optional)
Emits:
    updated, normed = k3::oproj_allreduce_residual(o, W_o, prefix, blocks, w_norm, w_qk, g, eps, group, prefetch=[],
                                                   rounding, mix_rounding)
with the rounding orders the post-norm and the mixer are written with (patterns.graph.match_rms_norm,
patterns.attnres: ops/reference.py's NORM_* / MIX_* bits), so that the op rounds as the graph did.
Skipped: model dtype not in options.dtypes, TP size not in options.tp_sizes, static M outside the
pass's batch range. On CUDA with Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py) (the
profitability gate, base.gated_off; the reason is in the report). A site whose GEMM is not followed
by exactly this chain is a near-miss, reported with the node where matching stopped. A site whose
all-reduce vLLM already fused (FlashInfer/AITER all-reduce + residual + RMSNorm,
`patterns.vllm_forms`) is left as vLLM fused it, listed in a note and not counted as expected.
"""
from __future__ import annotations

from ..ops import OPS
from ..patterns.attnres import match_attnres_from_norm
from ..patterns.graph import (Fail, c10d, match_all_reduce, match_linear, rms_norms_by_input, aten, is_call,
                              is_weight_like, strip, weight_out_in, describe)
from ..patterns.graph import why_not_rms_norm
from ..patterns.structure import op_name
from ..patterns.vllm_forms import prefused
from .base import K3Pass
from .pipeline import register
from .common import emit, forward_gemm, getitem, last_of, replace, users_through_views


@register
class FuseOprojAllreduce(K3Pass):
    name = "fuse_oproj_allreduce"
    description = "o-proj GEMM + all-reduce + residual add (+ RMSNorm/AttnRes post-norm) -> k3::oproj_allreduce_residual"
    pattern = "mm(o, W_o.T) -> [all_reduce] -> add(residual) [-> RMSNorm | AttnRes mix] (per attention layer)"
    emits = "k3::oproj_allreduce_residual"

    def expected(self, info):
        return info.n_attention

    @staticmethod
    def anchors(info):
        if info.layers:
            return [g for g in info.oproj if op_name(g) != "k3::oproj_allreduce_residual"]
        return [g if g is not None else core for core, g in ((c, forward_gemm(c)) for c in info.attention)]

    def run(self, graph, info, opts, report):
        norms = rms_norms_by_input(graph)
        post_norm = {}  # updated node -> AttnResSite
        unparsed = []   # AttnRes mixers (a norm of a sum over stacked sources) whose form did not match
        for sites in norms.values():
            for s in sites:
                if s.weight is None:
                    continue
                a = match_attnres_from_norm(s)
                if a:
                    post_norm.setdefault(a.updated, a)
                else:
                    unparsed.append(a)
        if unparsed:
            first = unparsed[0]
            report.notes.append(f"{len(unparsed)} AttnRes mixer(s) did not match (first at "
                                f"{getattr(first.node, 'name', first.node)}: {first.reason}); a site whose "
                                "post-norm is one is fused without it")
        for s in self.collect(self.anchors(info), lambda gemm: self.match(gemm, info, post_norm), report):
            if s["mix"] is None:
                why = why_not_rms_norm(s["updated"])
                if why:
                    report.notes.append(f"{s['updated'].name}: fused without its post-norm ({why})")
            self.rewrite(graph, s, info)
            report.matched += 1

    def match(self, gemm, info, post_norm):
        lin = match_linear(gemm)
        if isinstance(lin, Fail):
            return lin
        if not is_weight_like(lin.w):
            return Fail(gemm, f"o-proj weight is computed ({describe(strip(lin.w))}), not a parameter")
        if lin.bias is not None:
            return Fail(gemm, "o-proj has a bias (K3 has none)")
        group = None
        if lin.residual is not None:  # Inductor folded `prefix + o @ W.T` into addmm (TP=1 only)
            if info.tp > 1:
                return Fail(gemm, "residual added before the all-reduce")
            updated, residual = gemm, lin.residual
        else:
            y = gemm
            users = users_through_views(gemm)
            if info.tp > 1:
                ar = [u for u in users if is_call(u, c10d.all_reduce.default)]
                if len(users) != 1 or not ar:
                    pre = prefused(gemm)  # vLLM's FlashInfer/AITER fusion took this all-reduce
                    if pre is not None:
                        return pre
                    return Fail(gemm, f"o-proj output does not go straight into an all-reduce "
                                      f"(users: {', '.join(describe(u) for u in users)})")
                w = list(ar[0].users)
                arm = match_all_reduce(w[0]) if len(w) == 1 else Fail(ar[0], "all_reduce without a single wait")
                if isinstance(arm, Fail):
                    return arm
                y, group = arm.out, arm.group
                users = users_through_views(y)
            adds = [u for u in users if is_call(u, aten.add.Tensor)]
            if len(adds) != 1 or len(users) != 1:
                return Fail(y, f"o-proj result is not added to the residual exactly once "
                               f"(users: {', '.join(describe(u) for u in users)})")
            updated = adds[0]
            a, b = updated.args
            residual = b if strip(a) is y or a is y else a
        mix = post_norm.get(updated)
        return dict(lin=lin, updated=updated, residual=residual, group=group, mix=mix)

    def rewrite(self, graph, s, info):
        lin, updated, mix = s["lin"], s["updated"], s["mix"]
        w = weight_out_in(graph, lin, updated)
        if mix is not None:
            args = (lin.x, w, s["residual"], list(mix.blocks), mix.w_norm, mix.w_qk, mix.norm.weight,
                    mix.norm.eps, s["group"], [], mix.norm.rounding, mix.mix_rounding)
        else:
            args = (lin.x, w, s["residual"], [], None, None, None, 1e-6, s["group"], [], 0, 0)
        anchor = last_of(graph, [updated, w] + list(mix.blocks if mix else []))
        fused = emit(graph, anchor, OPS["oproj_allreduce_residual"], args)
        normed = getitem(graph, fused, 1) if mix is not None else None
        new_updated = getitem(graph, fused, 0)
        if normed is not None:
            replace(graph, mix.norm.out, normed)
        replace(graph, updated, new_updated)


