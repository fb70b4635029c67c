"""A LatentMoE layer's parts, found from its router top-k (patterns.roles gives the top-k).

- `selection(topk)`: the router's selection after its logits (K3-SPEC: sigmoid scores of the fp32
  logits, top-k of scores + correction bias, the selected scores renormalised, times a scale),
  verified by evaluation (patterns.semantic), so any spelling of the renormalisation or the bias
  matches. Returns a `router.RouterTopkSite`.
- `finalize(weights)`: the weighted top-k sum of the experts' unfinalised outputs [M, k, L] by the
  selection's weights: `(y * w[..., None]).sum(1)`, `bmm(w[:, None], y)`, `einsum("mk,mkd->md")`,
  in fp32 or the model dtype; verified by evaluation. Returns (y, the finalized node).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from . import semantic
from .graph import CONVERT_OPS, VIEW_OPS, Fail, aten, c10d, describe, is_call, is_weight_like, shape, strip, strip_converts
from .router import RouterTopkSite, match_router_topk

# ops a selection's renormalisation, or a finalize's weighting, is written with
_ARITH = {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.reciprocal.default,
          aten.sum.dim_IntList, aten.expand.default, *VIEW_OPS, *CONVERT_OPS}


def _getitem(n: Node, i: int) -> Node | None:
    return next((u for u in n.users if is_call(u, operator.getitem) and u.args[1] == i), None)


def _scores_and_logits(sel_in: Any) -> tuple[Node, Node] | Fail:
    """From the top-k's input (scores + bias) back to (the sigmoid, the logits it reads)."""
    seen, stack = set(), [sel_in]
    while stack:
        n = stack.pop()
        if not isinstance(n, Node) or n in seen:
            continue
        seen.add(n)
        if is_call(n, aten.sigmoid.default):
            return n, strip_converts(strip(n.args[0]))
        if is_call(n, aten.add.Tensor, aten.sub.Tensor, *VIEW_OPS, *CONVERT_OPS) and len(seen) < 12:
            stack.extend(a for a in n.args if isinstance(a, Node) and not is_weight_like(a))
    return Fail(sel_in, "the topk is not over `scores + correction bias` (sigmoid(logits) + bias)")


def _final_weights(gather: Node, m: int, k: int) -> Node | Fail:
    """The last [M, k] node of the arithmetic chain that starts at the gathered scores and is read
    outside it: the selection's weights."""
    chain, stack, order = {gather}, [gather], {n: i for i, n in enumerate(gather.graph.nodes)}
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in chain and is_call(u, *_ARITH) and shape(u) in ((m, k), (m, 1), (m,)) and len(chain) < 40:
                chain.add(u)
                stack.append(u)
    outs = [n for n in chain if shape(n) == (m, k) and any(u not in chain for u in n.users)]
    if not outs:
        return Fail(gather, "no [M, k] weights leave the renormalisation of the gathered scores")
    return max(outs, key=order.__getitem__)


def selection(topk: Node) -> RouterTopkSite | Fail:
    """The router selection site of an aten.topk node."""
    ids = _getitem(topk, 1)
    if ids is None:
        return Fail(topk, "the top-k's indices are not used")
    k = topk.args[1] if len(topk.args) > 1 else topk.kwargs.get("k")
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    largest = topk.args[3] if len(topk.args) > 3 else topk.kwargs.get("largest", True)
    if not isinstance(k, int) or dim not in (-1, 1) or largest is not True:
        return Fail(topk, f"topk(k={k}, dim={dim}, largest={largest}) is not a top-k over the experts")
    sl = _scores_and_logits(topk.args[0])
    if isinstance(sl, Fail):
        return sl
    values = _getitem(topk, 0)
    if values is not None and values.users:
        return Fail(topk, "the topk values are used (only the indices should be)")
    sig, logits = sl
    fast = match_router_topk(logits)   # the reference spelling, parsed structurally
    if not isinstance(fast, Fail):
        return fast
    gathers = [u for u in ids.users if is_call(u, aten.gather.default) and strip_converts(u.args[0]) is sig]
    if len(gathers) != 1:
        return Fail(ids, "the selected ids do not gather the sigmoid scores once")
    lshape = shape(logits)
    if lshape is None or len(lshape) != 2:
        return Fail(logits, "the router logits are not [M, E]")
    m, e = lshape
    w = _final_weights(gathers[0], m, k)
    if isinstance(w, Fail):
        return w
    def check(outs, xs, leaves):
        return _check_selection(topk, ids, w, gathers[0], logits, k, e, outs, xs, leaves)

    return semantic.evaluate([topk.args[0], ids, w], [logits], lambda g: [semantic.random_like(logits, g, 2.0)],
                             check)


def _check_selection(topk, ids, w, gather, logits, k, e, outs, xs, leaves):
    (sel_in, ids_v, w_v), (lv,) = outs, xs
    bias = [n for n in leaves if shape(n) == (e,)]
    if len(bias) != 1 or len(leaves) != 1:
        return Fail(topk, f"the selection reads {len(leaves)} parameter(s) "
                          f"({', '.join(n.name for n in leaves)}), expected one [E] correction bias")
    scores = torch.sigmoid(lv.float())
    if not semantic.close(sel_in.float() - scores, leaves[bias[0]].float().expand_as(scores), 1e-3, 1e-3):
        return Fail(topk, "the top-k ranks something other than sigmoid(logits) + bias")
    ref_ids = torch.topk(scores + leaves[bias[0]].float(), k, dim=-1).indices
    ids_s, perm = ids_v.long().sort(-1)
    if not torch.equal(ids_s, ref_ids.sort(-1).values):
        return Fail(ids, "the selected experts differ from top-k of sigmoid(logits) + bias")
    ref_w = scores.gather(-1, ids_s)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    got = w_v.float().gather(-1, perm)
    scale = float(got.sum(-1).mean())
    if not semantic.close(got, ref_w * scale, 1e-3, 1e-5):
        return Fail(w, "the weights are not the selected sigmoid scores renormalised (times a scale)")
    scale = float(f"{scale:.6g}")
    return RouterTopkSite(logits=logits, bias=bias[0], k=k, scale=scale, ids=ids, weights=w, gather=gather)


def finalize(weights: Node) -> tuple[Node, Node] | Fail:
    """(y [M, k, L], the finalized [M, L] node) for the selection's weights [M, k]."""
    ws = shape(weights)
    if ws is None or len(ws) != 2:
        return Fail(weights, "the top-k weights are not [M, k]")
    m, k = ws
    # forward from the weights through views / casts to the first op that combines them with a
    # [M, k, L] (or [M, 1, L] for bmm) tensor
    stack, seen = [weights], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if is_call(u, *VIEW_OPS, *CONVERT_OPS, aten.expand.default, aten.permute.default):
                stack.append(u)
                continue
            if is_call(u, aten.mul.Tensor, aten.bmm.default, aten.mm.default):   # mm: M=1, the batch squeezed
                other = u.args[1] if u.args[0] is n else u.args[0]
                y = _unview(other)
                ys = shape(y)
                if ys is None or len(ys) != 3 or tuple(ys[:2]) != (m, k):
                    continue
                out = _reduced(u, m, ys[2])
                if isinstance(out, Fail):
                    return out
                def check(outs, xs, leaves, y=y, out=out):
                    (fv,), (yv, wv) = outs, xs
                    if leaves:
                        return Fail(out, "the finalize reads parameters")
                    ref = (yv.float() * wv.float().unsqueeze(-1)).sum(1)
                    if not semantic.close(fv.float(), ref, 2e-2, 2e-2):
                        return Fail(out, "the weighted expert outputs are not summed over the top-k")
                    return y, out

                return semantic.evaluate([out], [y, weights], lambda g: [semantic.random_like(y, g),
                                                                        semantic.random_like(weights, g).abs()], check)
    return Fail(weights, "the top-k weights do not weight a [M, k, L] expert output")


def _unview(n: Any) -> Any:
    """Through views / casts / permutes to the [M, k, L] tensor they reshape."""
    while is_call(n, *VIEW_OPS, *CONVERT_OPS, aten.permute.default, aten.expand.default):
        if len(shape(n) or ()) == 3 and len(shape(n.args[0]) or ()) != 3:
            break
        n = n.args[0]
    return n


def _reduced(start: Node, m: int, L: int) -> Node | Fail:
    """From the weighting op forward (sum over k, views, casts) to the [M, L] result."""
    n = start
    for _ in range(8):
        if shape(n) == (m, L):
            nxt = [u for u in n.users if is_call(u, *CONVERT_OPS)]
            return nxt[0] if len(nxt) == 1 and len(n.users) == 1 else n
        us = list(n.users)
        if len(us) != 1 or not is_call(us[0], aten.sum.dim_IntList, *VIEW_OPS, *CONVERT_OPS, aten.permute.default):
            return Fail(n, f"the weighted expert outputs go to {', '.join(describe(u) for u in us)}, "
                           "not a sum over the top-k")
        n = us[0]
    return Fail(n, "no [M, L] finalized output")


def topk_weights(topk: Node) -> Node | Fail:
    """The selection's final weights for a router top-k: aten.topk's (found by `selection`), or
    output 1 of k3::router_topk (fuse_router_topk's op)."""
    if is_call(topk, aten.topk.default):
        s = selection(topk)
        return s if isinstance(s, Fail) else s.weights
    w = _getitem(topk, 1)
    return w if w is not None else Fail(topk, "the router op's weights are not used")


def moe_partial(delta: Node) -> Node:
    """The MoE's output before its all-reduce (the residual stream's delta, through the all-reduce)."""
    n = strip(delta, converts=True)
    if is_call(n, c10d.wait_tensor.default) and is_call(n.args[0], c10d.all_reduce.default):
        return n.args[0].args[0]
    return delta


def tail_add(up: Node, final: Node, rank: int) -> Node | Fail:
    """The shared-expert partial that `final` adds the up-projection `up` [M, n] into (this rank's
    columns [rank*n, (rank+1)*n), or all of them where n is the width), however that add is written
    (`+`, an in-place column slice `+=`, `narrow(...).add_`, `F.pad` then `+`); verified by evaluation."""
    fs, us = shape(final), shape(up)
    if fs is None or us is None or len(fs) != 2 or len(us) != 2:
        return Fail(final, "the MoE output or the tail is not 2-D")
    down, stack = {up}, [up]
    while stack and len(down) < 40:   # what depends on the tail (bounded: the add is near)
        for u in stack.pop().users:
            if u not in down:
                down.add(u)
                stack.append(u)
    if final not in down:
        return Fail(up, f"the tail does not reach the MoE output {final.name}")
    inside, stack = {final}, [final]   # the nodes between the tail and the MoE output
    while stack:
        for a in stack.pop().all_input_nodes:
            if a in down and a not in inside:
                inside.add(a)
                stack.append(a)
    leaves = {a for n in inside for a in n.all_input_nodes if a not in down}
    shared = [a for a in leaves if shape(a) == fs]
    if len(shared) != 1:
        return Fail(final, f"the tail is added to {len(shared)} [M, hidden] tensors, expected one shared partial")
    shared = shared[0]
    n, width = us[1], fs[1]
    lo = rank * n if n != width else 0

    def check(outs, xs, leaves_):
        (fv,), (uv, sv) = outs, xs
        ref = sv.float().clone()
        ref[:, lo:lo + n] += uv.float()
        if leaves_ or not semantic.close(fv.float(), ref, 2e-2, 2e-2):
            return Fail(final, f"the MoE output is not the shared partial with the tail added at columns "
                               f"[{lo}, {lo + n})")
        return shared

    return semantic.evaluate([final], [up, shared], lambda g: [semantic.random_like(up, g),
                                                                semantic.random_like(shared, g)], check)
