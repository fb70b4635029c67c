"""fold_moe_finalize: MXFP4 top-k finalize + latent tail -> one op.

Matches, once per MoE layer (anchored on the router's top-k, found by role: patterns.roles; the
finalize is where its weights meet the unfinalised [N, top_k, latent] expert results, whatever
computes them: patterns.moe.finalize, which takes `(y * w[..., None]).sum(1)`, bmm and einsum, and the
squeeze -> mm -> unsqueeze Inductor makes of the bmm at M=1 on a GPU, joint_graph.bmm_to_mm):
    routed_partial = sum_k(y * w[..., None])            # finalize (fp32, cast back)
    routed = all_reduce(routed_partial)                 # absent at TP=1
    tail = RMSNorm(routed) * g_latent @ W_up[r].T
    final_partial = shared_partial + tail               # TP=1 (or addmm(shared_partial, ., W_up[r].T))
    final_partial = slice_scatter(clone(shared_partial), slice(...) + tail, 1, r*n, (r+1)*n)   # TP>1
    (any other spelling of "add the tail at this rank's columns", `F.pad`, `narrow(...).add_`,
    is checked by evaluation: patterns.moe.tail_add)
Emits:
    final_partial = k3::moe_latent_tail(y, w, shared_partial, g_latent, W_up[r], eps, r, group, prefetch=[], rounding)
(rounding: the latent norm's rounding order as the graph computes it, patterns.graph.match_rms_norm)
In vLLM's Kimi K3 (the MoE in its opaque op, found by role: patterns.roles) the finalize is inside
`vllm::moe_forward_shared`, which returns (shared_partial, routed_partial [M, L], finalized), and its
LatentMoERunner writes the tail after it in one of two forms at TP > 1 (the TP=1 one is the first above):
    final = all_reduce(shared_partial) + RMSNorm(all_reduce(routed_partial)) * g_latent @ W_up.T
        # decode sizes on CUDA: the replicated W_up, the shared partial all-reduced on its own
    final_partial = slice_scatter(shared_partial, slice + RMSNorm(all_reduce(routed_partial)) * g_latent
                                  @ W_up[r*n:(r+1)*n].T, ...)     # prefill sizes (and vLLM's CPU platform)
Emitted with y = routed_partial[:, None] and weights 1 (the finalize of one expert: exact) and this
rank's rows of W_up; the first form gets one all-reduce after the op instead of its two:
    final = all_reduce(k3::moe_latent_tail(routed_partial[:, None], 1, shared_partial, g_latent, W_up[r], ...))
and lowers the matched layer's expert op, where it is k3model::mxfp4_experts, to k3::mxfp4_experts
(same arguments and contract; its CUDA dispatch runs the MXFP4 expert kernels). Expert results in
another dtype than the model's (fp32 plain-torch experts) are cast to it first (the model casts the
finalized sum; this rounds each expert's result, within bf16 tolerance).
Skipped: model dtype not in options.dtypes, TP size not in options.tp_sizes, static M outside the
pass's batch range. On CUDA with Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py) (the
profitability gate, base.gated_off; the reason is in the report). The latent all-reduce + RMSNorm as
vLLM's FlashInfer op (norm_out given, a residual of zeros: vLLM's AllReduceFusionPass, or its latent-MoE
runner on Hopper) is taken as that all-reduce + RMSNorm (`vllm_forms.flashinfer_norm_only`); one with
another residual or pattern (`patterns.vllm_forms`) is left as vLLM fused it, listed in a note and not
counted as expected.
"""
from __future__ import annotations

import torch

from ..ops import OPS
from ..patterns.graph import (CONVERT_OPS, Fail, aten, c10d, describe, dtype, is_call, is_weight_like, match_all_reduce,
                              match_linear, rms_norms_by_input, shape, strip, strip_converts, val, weight_out_in,
                              why_not_rms_norm)
from ..patterns.moe import finalize, moe_partial, tail_add, topk_weights
from ..patterns.roles import ResidualAdd, op_name
from ..patterns.graph import RmsNormSite
from ..patterns.vllm_forms import Prefused, flashinfer_norm_only, flashinfer_release, moe_op_outputs, prefused
from .base import K3Pass
from .pipeline import register
from .common import emit, last_of, replace, users_through_views


_MODEL_EXPERTS = torch.ops.k3model.mxfp4_experts.default


def _only_user(n, what):
    us = [u for u in users_through_views(n)]
    if len(us) != 1:
        return Fail(n, f"{what} has {len(us)} users ({', '.join(describe(u) for u in us)}), expected 1")
    return us[0]


@register
class FoldMoeFinalize(K3Pass):
    name = "fold_moe_finalize"
    description = "top-k finalize + latent all-reduce + RMSNorm + up-proj shard + add -> k3::moe_latent_tail"
    pattern = "sum_k(experts(...) * w) -> [all_reduce] -> RMSNorm -> mm(W_up[r].T) -> add(shared) (per MoE layer)"
    emits = "k3::moe_latent_tail, k3::mxfp4_experts (the layer's expert op, lowered)"

    def expected(self, info):
        return info.n_moe

    def run(self, graph, info, opts, report):
        norms = rms_norms_by_input(graph)
        anchors = info.moe if info.by_role else info.experts
        for s in self.collect(anchors, lambda e: self.match(e, info, norms), report):
            w_up = weight_out_in(graph, s["lin"], s["final"])
            if s.get("rows") is not None:   # the replicated W_up: this rank's rows
                w_up = emit(graph, last_of(graph, [w_up, s["norm"].out]), aten.slice.Tensor, (w_up, 0, *s["rows"]))
            y, w = s["y"], s["w"]
            if w is None:   # finalized already (inside vLLM's MoE op): one "expert" of weight 1, exact
                y = emit(graph, y, aten.unsqueeze.default, (y, 1))                  # [M, 1, L]
                w = _unit_weights(graph, y)                                          # [M, 1] fp32 ones
            if dtype(y) != dtype(s["shared"]):
                y = emit(graph, y, torch.ops.prims.convert_element_type.default, (y, dtype(s["shared"])))
            args = (y, w, s["shared"], s["norm"].weight, w_up, s["norm"].eps, info.rank if s["group"] else 0,
                    s["group"], [], s["norm"].rounding)
            fused = emit(graph, last_of(graph, [s["final"], w_up, w, s["shared"]]), OPS["moe_latent_tail"], args)
            if s.get("reduce") is not None:   # the partial with this rank's tail columns, then one all-reduce
                ar = emit(graph, fused, c10d.all_reduce.default, (fused, "sum", s["reduce"]))
                fused = emit(graph, ar, c10d.wait_tensor.default, (ar,))
            replace(graph, s["final"], fused)
            if s.get("flashinfer") is not None:
                flashinfer_release(s["flashinfer"])
            if s["y"].target is _MODEL_EXPERTS:
                s["y"].target = OPS["mxfp4_experts"]
            report.matched += 1

    def match(self, e, info, norms):
        if isinstance(e, ResidualAdd) and e.op is not None:   # vLLM's MoE op: the finalize is inside it
            return self.match_op(e, info, norms)
        if isinstance(e, ResidualAdd):   # a MoE found by role
            w = topk_weights(e.topk)
            if isinstance(w, Fail):
                return w
            f = finalize(w)
            if isinstance(f, Fail):
                return f
            y, routed_partial = f
            return self.tail(y, w, routed_partial, info, norms, moe_partial(e.delta) if e.delta is not None else None)
        y = e
        # finalize: sum over k of y * w[..., None], in fp32 or the model dtype
        mul = _only_user(y, "expert output")
        if is_call(mul, *CONVERT_OPS):
            mul = _only_user(mul, "expert output cast")
        if isinstance(mul, Fail):
            return mul
        if not is_call(mul, aten.mul.Tensor):
            return Fail(mul, f"expert output is not multiplied by the top-k weights (found {describe(mul)})")
        other = mul.args[1] if strip_converts(mul.args[0]) is y else mul.args[0]
        w = strip(other)
        if shape(w) is None or len(shape(w)) != 2:
            return Fail(mul, "top-k weights are not an [N, k] tensor")
        red = _only_user(mul, "weighted expert output")
        if isinstance(red, Fail):
            return red
        if not (is_call(red, aten.sum.dim_IntList) and list(red.args[1]) in ([1], [-2])):
            return Fail(red, f"finalize is not a sum over top-k (found {describe(red)})")
        routed_partial = red
        if len(red.users) == 1 and is_call(next(iter(red.users)), *CONVERT_OPS):
            routed_partial = next(iter(red.users))  # the cast back to the model dtype
        return self.tail(y, w, routed_partial, info, norms)

    def match_op(self, r, info, norms):
        """vLLM's vllm::moe_forward_shared returns (shared partial, routed partial), the routed one finalized
        in the latent width; the latent tail after it is this pass's (`tail`): the site's y is the routed
        partial, weighted once by 1."""
        name = op_name(r.op)
        shared, routed = moe_op_outputs(r.op)
        if name != "vllm::moe_forward_shared" or shared is None or routed is None:
            return Fail(r.op, f"{name} ({r.op.name}) gives no shared partial and routed partial to add the tail "
                              "to (vllm::moe_forward_shared's two outputs)")
        final = moe_partial(r.delta) if r.delta is not None else None
        return self.tail(routed, None, routed, info, norms, final)

    def tail(self, y, w, routed_partial, info, norms, final=None):
        """`_tail`, with the norm-only FlashInfer op it took (if any) as the site's "flashinfer"."""
        got = self._tail(y, w, routed_partial, info, norms, final)
        if isinstance(got, dict):
            us = users_through_views(routed_partial) if info.tp > 1 else []
            got["flashinfer"] = us[0] if len(us) == 1 and isinstance(
                flashinfer_norm_only(us[0], routed_partial), RmsNormSite) else None
        return got

    def _tail(self, y, w, routed_partial, info, norms, final=None):
        """From the finalized output on: [all-reduce ->] RMSNorm -> up GEMM -> add into the shared
        partial (`final`: the MoE's output before its all-reduce, where the layer was found by role)."""
        group = None
        routed = routed_partial
        norm = None
        if info.tp > 1:
            ar = _only_user(routed_partial, "finalized output")
            if isinstance(ar, Fail):
                return ar
            wait = next(iter(ar.users), None) if is_call(ar) else None
            arm = match_all_reduce(wait) if wait is not None else Fail(ar, "no all-reduce after the finalize")
            if isinstance(arm, Fail):
                fi = flashinfer_norm_only(ar, routed_partial)   # vLLM's FlashInfer all-reduce + RMSNorm, no residual
                if isinstance(fi, RmsNormSite):
                    norm, group = fi, info.group
                else:
                    pre = prefused(routed_partial)  # vLLM fused this all-reduce with the latent RMSNorm
                    if pre is not None:
                        return Prefused(pre.node, f"{pre.reason} ({fi.reason})") if fi is not None else pre
                    return Fail(ar, f"finalized output is not all-reduced ({arm.reason})")
            else:
                routed, group = arm.out, arm.group
        if norm is None:
            cand = [s for s in {id(s): s for k in {routed, strip_converts(routed)} for s in norms.get(k, [])}.values()
                    if s.weight is not None]
            if len(cand) != 1:
                why = why_not_rms_norm(routed) or why_not_rms_norm(strip_converts(routed))
                return Fail(routed, "routed output is not followed by one weighted RMSNorm" + (f" ({why})" if why else ""))
            norm = cand[0]
        up = _only_user(norm.out, "latent norm")
        if isinstance(up, Fail):
            return up
        lin = match_linear(up)
        if isinstance(lin, Fail):
            return lin
        if not is_weight_like(lin.w) and not _weight_rows(lin.w):
            return Fail(up, "up-projection weight is computed, not a parameter")
        if lin.residual is not None:  # Inductor folded the add into addmm(c, ln, W_up.T)
            if info.tp == 1:
                return dict(y=y, w=w, group=group, norm=norm, lin=lin, shared=lin.residual, final=up)
            return self._slice_form(lin.residual, up, info, y, w, group, norm, lin)
        add = _only_user(up, "up-projection")
        if isinstance(add, Fail):
            return add
        if is_call(add, aten.add.Tensor):
            other = add.args[0] if strip(add.args[1]) is strip(up) else add.args[1]
            if info.tp > 1 and group is not None and shape(up) == shape(add):
                m = self._replicated_form(other, add, info, y, w, group, norm, lin)
                if m is not None:
                    return m
            if info.tp == 1 or shape(up) == shape(add):
                return dict(y=y, w=w, group=group, norm=norm, lin=lin, shared=other, final=add)
            m = self._slice_form(other, add, info, y, w, group, norm, lin)
            if not isinstance(m, Fail) or final is None:
                return m
        if final is None:
            return Fail(add, f"tail is not added to the shared partial (found {describe(add)})")
        shared = tail_add(up, final, info.rank)
        if isinstance(shared, Fail):
            return shared
        return dict(y=y, w=w, group=group, norm=norm, lin=lin, shared=shared, final=final)

    def _replicated_form(self, other, add, info, y, w, group, norm, lin):
        """TP>1 with the full replicated W_up (vLLM's tail at decode sizes): the tail [M, H] is added to
        the separately all-reduced shared partial, `all_reduce(shared) + RMSNorm(all_reduce(routed)) @ W_up.T`.
        Equal to one all-reduce of the shared partial with this rank's rows of the tail added at its
        columns: the site, with `rows` (this rank's rows of W_up) and `reduce` (the all-reduce after the
        op). None where `other` is not such an all-reduce (then the add is read as it is); a Fail where
        it is one that cannot be taken."""
        arm = match_all_reduce(other)
        if isinstance(arm, Fail):
            return None
        width = shape(add)[-1]
        if arm.group != group:
            return Fail(other, f"the shared partial is all-reduced on {arm.group}, the latent on {group}: "
                               "one all-reduce cannot take both")
        if [str(d) for d in shape(arm.inp) or ()] != [str(d) for d in shape(add)]:
            return Fail(other, f"the all-reduced tensor {describe(arm.inp)} is not the [M, hidden] shared partial")
        if width % info.tp:
            return Fail(lin.out, f"the up-projection's {width} rows do not split evenly over TP={info.tp}")
        if len(users_through_views(strip(other))) != 1 or not is_weight_like(lin.w):
            return Fail(other, "the all-reduced shared partial is read elsewhere too (or W_up is computed): "
                               "the tail cannot move before its all-reduce")
        n = width // info.tp
        return dict(y=y, w=w, group=group, norm=norm, lin=lin, shared=strip(arm.inp), final=add,
                    rows=(info.rank * n, (info.rank + 1) * n), reduce=group)

    def _slice_form(self, other, add, info, y, w, group, norm, lin):
        """TP>1: shared[:, r*n:(r+1)*n] += tail -> slice_scatter(clone(shared), slice + tail, 1, a, b)."""
        up = lin.out
        if not is_call(other, aten.slice.Tensor):
            return Fail(other, "tail is added to something other than a column slice of the shared partial")
        base, dim, a, b = other.args[0], other.args[1], other.args[2], other.args[3]
        n = shape(up)[-1]
        if dim not in (1, -1) or a != info.rank * n or b != (info.rank + 1) * n:
            return Fail(other, f"tail added at columns [{a}, {b}), expected this rank's [{info.rank * n}, {(info.rank + 1) * n})")
        sc = [u for u in add.users if is_call(u, aten.slice_scatter.default)]
        if len(sc) != 1 or sc[0].args[0] is not base:
            return Fail(add, "the column update is not scattered back into the shared partial")
        rows = _weight_rows(lin.w)
        if rows is not None and rows[1:] != (a, b):   # a slice of the replicated W_up: this rank's rows
            return Fail(lin.w, f"the up-projection reads rows [{rows[1]}, {rows[2]}) of W_up, not this rank's "
                               f"[{a}, {b})")
        return dict(y=y, w=w, group=group, norm=norm, lin=lin, shared=strip(base), final=sc[0])


def _weight_rows(w):
    """(W, start, end) where w is rows [start, end) of a weight W (`W.narrow(0, ...)`, vLLM's column-parallel
    tail over its replicated up-projection), else None."""
    if is_call(w, aten.slice.Tensor) and len(w.args) >= 4 and w.args[1] == 0 and is_weight_like(w.args[0]) \
            and isinstance(w.args[2], int) and isinstance(w.args[3], int):
        return w.args[0], w.args[2], min(w.args[3], shape(w.args[0])[0])
    return None


def _unit_weights(graph, y):
    """`full([M, 1], 1.0, float32)` right after y [M, k=1, L] (M through sym_size where it is symbolic)."""
    from contextlib import nullcontext

    from torch._guards import detect_fake_mode
    from .common import inherit
    m = shape(y)[0]
    anchor = y
    if not isinstance(m, int):
        with graph.inserting_after(y):
            anchor = inherit(graph.call_function(aten.sym_size.int, (y, 0)), y)
        anchor.meta["val"] = m
    kw = {"dtype": torch.float32, "device": val(y).device, "pin_memory": False}
    with graph.inserting_after(anchor):
        w = inherit(graph.call_function(aten.full.default, ([anchor if anchor is not y else m, 1], 1.0), kw), y)
    with (detect_fake_mode([val(y)]) or nullcontext()):
        w.meta["val"] = torch.full((m, 1), 1.0, **kw)
    return w
