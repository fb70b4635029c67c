"""fuse_residual_norm: a layer's input residual add (+ the all-reduce of what it adds) and the
AttnRes / RMSNorm after it -> one op.

Matches every AttnRes mixer or RMSNorm fed by a residual add that fuse_oproj_allreduce left
(the pre-attention mixer of each layer but the first, and the final norm before the LM head):
    delta = all_reduce(partial)          # the previous layer's MLP / MoE output at TP > 1; at TP=1,
                                         # or where delta is a graph input (one layer traced), no all-reduce
    updated = prefix + delta             # or Inductor's addmm(prefix, h, W.T) at TP=1 (delta = h @ W.T)
    normed = RMSNorm(updated) * g        # or the AttnRes mixer over [blocks..., updated]
Emits:
    updated, normed = k3::residual_norm(partial, prefix, blocks, w_norm, w_qk, g, eps, group, prefetch=[],
                                        rounding, mix_rounding)
with the rounding orders the norm and the mixer are written with (patterns.graph.match_rms_norm,
patterns.attnres: ops/reference.py's NORM_* / MIX_* bits), so that the op rounds as the graph did.
On CUDA one Triton kernel (the o-proj op's all-reduce + residual + norm kernel without its GEMM)
replaces the NCCL all-reduce and Inductor's mixer kernels (4-6 reductions for three blocks).
Expected: one site per MLP / MoE residual add found by role (patterns.roles: each layer's but the
first is the next layer's input; the last one's is the final norm's). Not counted: the post-attention mixers, whose delta is an o-proj GEMM's
(fuse_oproj_allreduce's sites, when that pass is off). An all-reduce whose result is read
elsewhere too stays, and only the add and the norm are fused (a note says so). A layer input
that vLLM's all-reduce fusion already took (FlashInfer / AITER, patterns.vllm_forms) is left as it is,
named in a note and not counted as expected. A layer input whose AttnRes mixer has no output norm
(vLLM's Kimi K3 ends its graph with the output mixer; the final norm runs in compute_logits) is a
near-miss naming it, not counted as expected: k3::residual_norm always normalises. The mixer after a
block-write layer's attention, whose prefix restarts at the attention output (vLLM), is no site.
Skipped: model dtype not in options.dtypes, TP size not in options.tp_sizes, static M outside the
pass's batch range; on CUDA with Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py) (the
profitability gate, base.gated_off). A mixer that does not parse (patterns.attnres) is a near-miss.
"""
from __future__ import annotations

from ..ops import OPS
from ..patterns.attnres import _find_mixer, match_attnres_from_norm
from ..patterns.graph import (CONVERT_OPS, VIEW_OPS, Fail, NoSite, aten, describe, is_call, match_all_reduce,
                              match_linear, rms_norms_by_input, shape, strip)
from ..patterns.vllm_forms import is_vllm_fused_allreduce
from .base import K3Pass
from .pipeline import register
from .common import emit, getitem, last_of, replace, users_through_views
from .fuse_oproj_allreduce import FuseOprojAllreduce


@register
class FuseResidualNorm(K3Pass):
    name = "fuse_residual_norm"
    description = "layer-input all-reduce + residual add + AttnRes/RMSNorm -> k3::residual_norm"
    pattern = "[all_reduce(partial) ->] add(prefix, delta) -> RMSNorm | AttnRes mix (per layer input, final norm)"
    emits = "k3::residual_norm"

    def expected(self, info):
        return len(info.ffn) if info.stream else len(info.attention)

    def run(self, graph, info, opts, report):
        oproj = set(FuseOprojAllreduce.anchors(info))
        pre = [n for n in graph.nodes if _vllm_fused_layer_input(n, oproj)]
        if pre:   # vLLM's FlashInfer / AITER all-reduce fusion took these: left as it fused them
            report.expected -= len(pre)
            report.notes.append(f"{len(pre)} site(s) already fused by vLLM (all-reduce + residual add + RMSNorm at a "
                                f"layer input: {', '.join(n.name for n in pre)}); left as vLLM fused them, not counted "
                                "as expected")
        norms = {s.out: s for sites in rms_norms_by_input(graph).values() for s in sites
                 if s.weight is not None and s.out.users}   # anchored (and reported) at each norm's output
        stream = {r.add: r for r in info.stream}   # the residual adds found by role: their prefix and delta
        sites = [s for s in self.collect(list(norms), lambda n: self.match(norms[n], oproj, stream), report)
                 if s is not None]
        taken = {s["updated"] for s in sites} | {nm.site for nm in report.near_misses}
        for r in info.ffn if info.stream else []:   # a layer input no norm reads: say why, by name
            if r.add in taken or r.add.name in taken:
                continue
            why = _unnormed_mixer(r.add)
            if why is not None:
                self.collect([r.add], lambda _a, why=why: why, report)
        for s in _one_per_add(sites):
            if s["kept_ar"]:
                report.notes.append(f"{s['updated'].name}: its all-reduce is read elsewhere too; "
                                    "fused the add and the norm only")
            self.rewrite(graph, s)
            report.matched += 1
        if report.matched < report.expected and not report.near_misses:
            report.notes.append(f"{report.expected - report.matched} expected layer input(s) unmatched: no norm after "
                                "their residual add was read as a residual add + RMSNorm / AttnRes mixer site, "
                                "so there is no near-miss to show")

    def match(self, norm, oproj, stream=None):
        """A site dict; None where the norm is not a residual add's (not this pass's business)."""
        mix = match_attnres_from_norm(norm)
        if isinstance(mix, Fail):
            return mix
        add = mix.updated
        if is_call(add, aten.addmm.default):   # Inductor folded `prefix + h @ W.T` (TP=1) into the GEMM
            lin = match_linear(add)
            if isinstance(lin, Fail) or lin.residual is None:
                return None if not isinstance(lin, Fail) else lin
            if strip(add) in oproj:
                return None   # a post-attention mixer: fuse_oproj_allreduce's site
            return dict(mix=mix, updated=add, prefix=lin.residual, partial=None, gemm=add.args[1:3], group=None,
                        kept_ar=False)
        if not is_call(add, aten.add.Tensor):
            if any(strip(r.prefix, converts=True) is strip(add, converts=True) for r in (stream or {}).values()):
                return None   # the prefix restarts here (vLLM's block-write layer): no add, no layer input
            if mix.blocks:   # a mixer always mixes a residual stream: its newest source should be the add
                return Fail(add, f"the AttnRes mixer's newest source is {describe(add)}, not a residual add")
            return None   # a plain RMSNorm of something else (q_a, kv_a, the latent, the first layer's input)
        a, b = add.args
        if not all(hasattr(x, "op") for x in (a, b)):
            return None   # x + constant
        role = (stream or {}).get(add)
        if role is not None:
            if role.kind == "attention":
                return None   # a post-attention mixer: fuse_oproj_allreduce's site
            a, b = role.prefix, role.delta
        if shape(a) != shape(b) or len(shape(add) or ()) != 2:
            return Fail(add, f"residual add of operands shaped {shape(a)} and {shape(b)}, not two [M, hidden]")
        ar = next((r for r in (match_all_reduce(b), match_all_reduce(a)) if not isinstance(r, Fail)), None)
        delta = ar.out if ar else b
        prefix = a if strip(delta) is strip(b) else b
        partial, group, kept = delta, None, False
        if ar is not None:
            if len(users_through_views(ar.out)) == 1:
                partial, group = ar.inp, ar.group
            else:
                kept = True
        if strip(partial) in oproj or strip(delta) in oproj:
            return None   # a post-attention mixer: fuse_oproj_allreduce's site
        return dict(mix=mix, updated=add, prefix=prefix, partial=partial, gemm=None, group=group, kept_ar=kept)

    def rewrite(self, graph, s):
        mix = s["mix"]
        anchor = last_of(graph, [s["updated"], mix.norm.weight] + list(mix.blocks))
        partial = s["partial"]
        if s["gemm"] is not None:   # the addmm form: its GEMM without the residual, then the op
            partial = anchor = emit(graph, anchor, aten.mm.default, tuple(s["gemm"]))
        args = (partial, s["prefix"], list(mix.blocks), mix.w_norm, mix.w_qk, mix.norm.weight, mix.norm.eps,
                s["group"], [], mix.norm.rounding, mix.mix_rounding)
        fused = emit(graph, anchor, OPS["residual_norm"], args)
        replace(graph, mix.norm.out, getitem(graph, fused, 1))
        replace(graph, s["updated"], getitem(graph, fused, 0))


def _one_per_add(sites: list[dict]) -> list[dict]:
    """One site per residual add: an unrolled AttnRes mixer also normalises `updated` itself, as a
    source of its logits (a plain RMSNorm of the add); the mixer's output norm is the site: the one
    that mixes blocks, else the last in graph order."""
    order = {}
    best: dict = {}
    for i, s in enumerate(sites):
        k = s["updated"]
        order.setdefault(k, i)
        if k not in best or len(s["mix"].blocks) >= len(best[k]["mix"].blocks):
            best[k] = s
    return sorted(best.values(), key=lambda s: order[s["updated"]])


def _vllm_fused_layer_input(n, oproj) -> bool:
    """n is vLLM's fused all-reduce + residual add + RMSNorm (patterns.vllm_forms) on something other
    than an o-proj GEMM's output (those are fuse_oproj_allreduce's): a layer input it already fused.
    Its all-reduce + norm form without the add (`norm_out` given: the latent norm) is not one."""
    if not is_vllm_fused_allreduce(n):
        return False
    x = n.kwargs.get("allreduce_in")
    return x is not None and n.kwargs.get("norm_out") is None and strip(x) not in oproj


def _unnormed_mixer(add) -> NoSite | None:
    """The AttnRes mixer over the layer input `add` where nothing normalises its output (vLLM's Kimi K3
    ends its graph with the output mixer; the model's final norm runs in compute_logits, outside the
    compiled graph): no residual + norm site. None where no such mixer reads `add`."""
    seen, todo = {add}, [add]
    while todo and len(seen) < 80:
        n = todo.pop(0)
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            todo.append(u)
            if not is_call(u, aten.sum.dim_IntList):
                continue
            f = _find_mixer(u)
            if f is None or strip(f.updated, converts=True) is not strip(add, converts=True):
                continue
            out, hops = u, 0
            while len(out.users) == 1 and hops < 4 and is_call(next(iter(out.users)), *CONVERT_OPS, *VIEW_OPS):
                out, hops = next(iter(out.users)), hops + 1
            readers = list(out.users)
            end = any(r.op == "output" for r in readers)
            goes = ("is the graph's output; vLLM applies the model's final norm in compute_logits, outside the "
                    "compiled graph" if end else f"goes to {', '.join(describe(r) for r in readers) or 'nothing'}")
            return NoSite(u, f"the AttnRes mixer over this layer input has no output RMSNorm (its result {goes}): "
                             "k3::residual_norm always normalises its output")
    return None
