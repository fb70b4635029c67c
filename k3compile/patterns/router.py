"""The K3 router's selection after its logits GEMM (K3-SPEC: noaux_tc, one group):

    scores = sigmoid(fp32(logits))                       # [N, E]
    ids    = topk(scores + bias, k, dim=-1).indices      # bias: a replicated fp32 [E] parameter
    w      = gather(scores, -1, ids)
    w      = w / w.sum(-1, keepdim=True) (* scale)       # routed_scaling_factor, 1.0 in K3

`match_router_topk(logits)` returns the site (the nodes whose values k3::router_topk replaces:
the ids and the final weights) or a Fail naming the node where the chain differs.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from torch.fx import Node

from .graph import CONVERT_OPS, Fail, aten, is_call, is_weight_like, scalar, shape, strip


@dataclass
class RouterTopkSite:
    logits: Node
    bias: Node
    k: int
    scale: float
    ids: Node      # getitem(topk, 1)
    weights: Node  # the renormalised (scaled) weights
    gather: Node   # gather(scores, -1, ids): the selection's own use of the ids


def _only(users, *targets) -> list[Node]:
    return [u for u in users if is_call(u, *targets)]


def match_router_topk(logits: Any) -> RouterTopkSite | Fail:
    n = logits
    conv = _only(n.users, *CONVERT_OPS)
    sig = _only((conv[0] if len(conv) == 1 else n).users, aten.sigmoid.default)
    if len(sig) != 1:
        return Fail(n, "router logits do not feed one sigmoid (fp32 scores)")
    sig = sig[0]
    adds = _only(sig.users, aten.add.Tensor)
    if len(adds) != 1:
        return Fail(sig, "router scores do not feed one `+ correction bias`")
    add = adds[0]
    bias = add.args[1] if strip(add.args[0]) is sig else add.args[0]
    if not is_weight_like(bias) or shape(bias) is None or len(shape(bias)) != 1:
        return Fail(add, "the score correction is not a 1-D parameter")
    tks = _only(add.users, aten.topk.default)
    if len(tks) != 1:
        return Fail(add, "biased scores do not feed one topk")
    tk = tks[0]
    k = tk.args[1] if len(tk.args) > 1 else tk.kwargs.get("k")
    dim = tk.args[2] if len(tk.args) > 2 else tk.kwargs.get("dim", -1)
    largest = tk.args[3] if len(tk.args) > 3 else tk.kwargs.get("largest", True)
    if not isinstance(k, int) or dim not in (-1, 1) or largest is not True:
        return Fail(tk, f"topk(k={k}, dim={dim}, largest={largest}) is not a top-k over the experts")
    gets = {u.args[1]: u for u in tk.users if is_call(u, operator.getitem)}
    if 1 not in gets or set(gets) - {0, 1} or (0 in gets and gets[0].users):
        return Fail(tk, "the topk values are used (only the indices should be)")
    ids = gets[1]
    gat = [u for u in ids.users if is_call(u, aten.gather.default) and u.args[0] is sig]
    if len(gat) != 1:
        return Fail(ids, "the selected ids do not gather the unbiased scores")
    g = gat[0]
    sums = _only(g.users, aten.sum.dim_IntList)
    divs = _only(g.users, aten.div.Tensor)
    if len(sums) != 1 or len(divs) != 1 or divs[0].args[1] is not sums[0] or not sums[0].args[2:3] == (True,) \
            or list(sums[0].args[1]) not in ([-1], [1]):
        return Fail(g, "the gathered scores are not renormalised (w / w.sum(-1, keepdim=True))")
    out, scale = divs[0], 1.0
    muls = _only(out.users, aten.mul.Tensor)
    if len(out.users) == 1 and len(muls) == 1 and scalar(muls[0].args[1]) is not None:
        out, scale = muls[0], scalar(muls[0].args[1])
    return RouterTopkSite(logits=n, bias=bias, k=k, scale=scale, ids=ids, weights=out, gather=g)
