"""fuse_router_topk: the K3 router's expert selection after its logits -> one k3::router_topk.

Matches, once per MoE layer (anchored on the router's top-k, found by role: patterns.roles), at any
TP size, on the router's logits however they were computed (`x @ W_r.T` in fp32 or the model dtype,
a split of one GEMM, or the sharded GEMM + all-gather shard_router_latent emits):
    scores = sigmoid(fp32(logits))                        # [N, E]
    ids    = topk(scores + bias, k, dim=-1).indices       # bias: a 1-D parameter (noaux_tc)
    w      = gather(scores, -1, ids)
    w      = w / w.sum(-1, keepdim=True) (* scale)
(`patterns.moe.selection` checks it: the reference spelling structurally, any other by evaluating
the chain against this math, so a renormalisation with an eps, `w * (s / w.sum())` or a bias added
through a view all match.)
Emits:
    ids, w = k3::router_topk(logits, bias, k, scale, ids_int32)
(ids_int32 where only expert ops read the ids: the kernel writes int32 ids, which the expert kernels
read, instead of int64 ids and a conversion kernel before the experts: 1.1 us at M=1 on an H200.)
On CUDA one Triton kernel (kernels/triton_router.py) instead of Inductor's sigmoid + add kernel,
torch.topk's two (a radix select and a sort: 8.6 + 3.9 us at M=1, E=896 on an H200) and the
renormalisation: 5.2-5.4 us at M = 1..64 (bench/router_bench.py, BENCHMARKS.md). Its reference is
the chain above in PyTorch (ops/reference.router_topk), bit-identical on CPU.
Not counted as expected: a MoE whose selection is inside vLLM's opaque MoE op (vllm::moe_forward_shared
takes the logits and selects inside): a near-miss naming the op.
Skipped: model dtype / TP size not supported, static M outside the pass's batch range; on CUDA with
Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py). Near-miss: expert ids that are not the indices of
a topk over `sigmoid(logits) + bias` (say which step differs), or a selection that differs
(softmax scores, the top-k values used, no renormalisation: match_router_topk's reason).
"""
from __future__ import annotations

import operator

from ..ops import OPS
from ..patterns.graph import Fail, aten, describe, is_call, strip, strip_converts
from ..patterns.moe import selection
from ..patterns.roles import ResidualAdd
from ..patterns.router import match_router_topk
from ..patterns.vllm_forms import inside_moe_op
from .base import K3Pass
from .pipeline import register
from ..patterns.structure import EXPERT_OPS, op_name
from .common import emit, getitem, replace


def router_logits(ids):
    """The logits node whose selection produced the expert ids `ids` (getitem 1 of a topk over
    sigmoid(logits) + bias), or a Fail at the step where the chain differs."""
    ids = strip(ids, converts=True)
    if not (is_call(ids, operator.getitem) and ids.args[1] == 1 and is_call(ids.args[0], aten.topk.default)):
        return Fail(ids, "the expert ids are not the indices of a topk")
    tk = ids.args[0]
    add = tk.args[0]
    if not is_call(add, aten.add.Tensor):
        return Fail(tk, "the topk is not over `scores + correction bias`")
    sig = [a for a in add.args[:2] if is_call(strip(a), aten.sigmoid.default)]
    if len(sig) != 1:
        return Fail(add, "the biased scores are not `sigmoid(logits) + bias`")
    return strip_converts(strip(sig[0]).args[0])


@register
class FuseRouterTopk(K3Pass):
    name = "fuse_router_topk"
    description = "the router's selection (sigmoid, + bias, topk, gather, renormalise) -> k3::router_topk"
    pattern = "topk(sigmoid(fp32(logits)) + bias).indices -> the expert op; gather + w / w.sum (* scale) (per MoE layer)"
    emits = "k3::router_topk"

    def expected(self, info):
        return info.n_moe

    @staticmethod
    def anchors(info):
        if info.by_role:   # a MoE in vLLM's opaque op: itself (its selection is inside the op: no site)
            return [r if r.op is not None else r.topk for r in info.moe
                    if r.op is not None or is_call(r.topk, aten.topk.default)]
        return list(info.experts)

    def run(self, graph, info, opts, report):
        for site in self.collect(self.anchors(info), self.match, report):
            # int32 ids where only expert ops read them (their kernels take int32: no conversion kernel);
            # the selection's own gather dies with the weights it computed
            # (EXPERT_OPS: k3's and the model's MXFP4 expert ops, not names a user adds)
            i32 = all(u is site.gather or (op_name(u) in EXPERT_OPS and u.args[1] is site.ids
                                           and site.ids not in u.args[2:]) for u in site.ids.users)
            sel = emit(graph, site.logits, OPS["router_topk"], (site.logits, site.bias, site.k, site.scale, i32))
            w = getitem(graph, sel, 1)
            ids = getitem(graph, sel, 0)
            if i32:
                for u in list(site.ids.users):
                    u.replace_input_with(site.ids, ids)
            else:
                replace(graph, site.ids, ids)
            replace(graph, site.weights, w)
            report.matched += 1

    @staticmethod
    def match(e):
        if isinstance(e, ResidualAdd):
            return inside_moe_op(e, "the router's selection (sigmoid, + bias, top-k, renormalise)")
        if is_call(e, aten.topk.default):
            return selection(e)
        logits = router_logits(e.args[1])
        if isinstance(logits, Fail):
            return logits
        site = match_router_topk(logits)
        if not isinstance(site, Fail) and site.ids is not strip(e.args[1], converts=True):
            return Fail(e, f"the expert ids do not come from the selection on {describe(logits)}")
        return site
