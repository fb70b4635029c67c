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
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from . import semantic
from .graph import (CONVERT_OPS, VIEW_OPS, Fail, aten, c10d, concrete, describe, is_call, is_weight_like, scalar, shape,
                    strip, strip_converts, val)
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
    """From the weighting op forward (sum over k, views, casts) to the [M, L] result: where views
    take that result out of [M, L] and back (GPU Inductor's bmm -> mm at M=1: `mm -> unsqueeze(0) ->
    permute -> reshape`), the last [M, L] node of that chain, so that its users (the cast back, the
    all-reduce, the latent norm) are the finalized output's."""
    n = start
    for _ in range(8):
        if shape(n) == (m, L):
            n = _relaid(n, m, L)
            nxt = [u for u in n.users if is_call(u, *CONVERT_OPS)]
            return nxt[0] if len(nxt) == 1 and len(n.users) == 1 else n
        us = list(n.users)
        if len(us) != 1 or not is_call(us[0], aten.sum.dim_IntList, *VIEW_OPS, *CONVERT_OPS, aten.permute.default):
            return Fail(n, f"the weighted expert outputs go to {', '.join(describe(u) for u in us)}, "
                           "not a sum over the top-k")
        n = us[0]
    return Fail(n, "no [M, L] finalized output")


def _relaid(n: Node, m: int, L: int) -> Node:
    """The last [M, L] node of the single-user chain of views / permutes after n (n itself if none).
    Inductor's joint-graph pass `bmm_to_mm` (torch/_inductor/fx_passes/joint_graph.py, GPU tensors
    only) rewrites a bmm of batch 1, the finalize's at M=1, as `mm(a.squeeze(0), b.squeeze(0))
    .unsqueeze(0)`, before the views that moved the bmm's [1, 1, L] result to [M, L]; the mm is
    [M, L] already. The caller's evaluation checks the chain keeps the values where they were."""
    last = n
    for _ in range(8):
        us = list(n.users)
        if len(us) != 1 or not is_call(us[0], *VIEW_OPS, aten.permute.default) or us[0].args[0] is not n:
            break
        n = us[0]
        if shape(n) == (m, L):
            last = n
    return last


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


# ------------------------------------------------------------------------------ plain-torch MXFP4 experts
@dataclass
class ExpertsSite:
    """The routed experts written in plain torch: y [M, k, L] computed from the latent x [M, L] and the
    selected ids [M, k] with the packed MXFP4 weights (K3-SPEC: w13 [E, 2I, L/2] codes + [E, 2I, L/32]
    E8M0 scales, w2 [E, L, I/2] + [E, L, I/32])."""
    y: Node
    x: Node
    ids: Node
    w13: Node
    w13_scale: Node
    w2: Node
    w2_scale: Node
    beta: float
    linear_beta: float


# the most values of one dequantised [M, k, 2I, L] tensor the verification runs (about 256 MB in fp32;
# M = 1 and 2 at K3's TP=8 per-rank widths)
_VERIFY_MAX = 1 << 26
# SiTU's (beta, linear_beta) to try: the spec's, then any pair of the region's tanh divisors
_SITU = ((4.0, 25.0),)


def experts(y: Node, ids: Node) -> ExpertsSite | Fail:
    """The plain-torch routed experts behind y (the finalize's [M, k, L] input), verified by running
    the region on random codes, scales, latent and ids against k3model::mxfp4_experts."""
    ys, ids_s = shape(y), shape(ids)
    if ys is None or ids_s is None or len(ys) != 3 or tuple(ys[:2]) != tuple(ids_s):
        return Fail(y, "the expert outputs are not [M, k, L] for the selected ids")
    m, k, L = ys
    xs = _latent_candidates(y, ids, m, L)
    if not xs:
        return Fail(y, f"no [M, {L}] latent input found behind the expert outputs")
    why = None
    for x in xs:
        r = semantic.region([y], [x, ids])
        if isinstance(r, Fail):
            why = why or r
            continue
        nodes, leaves = r
        opaque = [n for n in nodes if not _is_aten(n)]
        if opaque:
            return Fail(opaque[0], f"the experts are computed by an opaque op ({describe(opaque[0])}): "
                                   "only plain-torch experts are lowered")
        got = _classify(leaves, L, y)
        if isinstance(got, Fail):
            return got
        w13, s13, w2, s2 = got
        divs = sorted({scalar(n.args[1]) for n in nodes if is_call(n, aten.div.Tensor) and scalar(n.args[1])
                       and any(is_call(u, aten.tanh.default) for u in n.users)} - {None})
        tries = list(_SITU) + ([(divs[0], divs[1]), (divs[1], divs[0])] if len(divs) == 2 else [])
        # the experts as k of them: the region gathers the selected ones, so E appears only in the
        # weights' shapes (a region that bakes E into a view does not run and is not this site)
        E = concrete(k)
        two_i = concrete(shape(w13)[1])
        size = (concrete(m) or 1) * E * two_i * concrete(L)
        if size > _VERIFY_MAX:
            return Fail(y, f"the experts' dequantised weights ({size} values for M={m}) are too large to verify "
                           f"when compiling (limit {_VERIFY_MAX}): compile at a smaller M, or use an expert op")

        def leaf_value(n, gen):
            v = val(n)
            if n in (w13, w2, s13, s2):
                lo, hi = (0, 256) if n in (w13, w2) else (119, 124)
                return torch.randint(lo, hi, (E, *(concrete(s) for s in v.shape[1:])), generator=gen).to(torch.uint8)
            if n.op == "get_attr":       # a constant (a value table): its own value
                return _attr(n)
            return Fail(n, f"the experts read {n.name} {tuple(v.shape)} {v.dtype}, a graph input whose values are "
                           "not known when compiling (a value table passed in: make it a constant)")

        def inputs(gen):
            xv = torch.randn(m, L, generator=gen).to(val(x).dtype)
            iv = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(m)]).to(val(ids).dtype)
            return [xv, iv]

        def check(outs, xv, lv, w13=w13, s13=s13, w2=w2, s2=s2, x=x):
            (yv,), (xx, iv) = outs, xv
            for beta, lb in tries:
                ref = torch.ops.k3model.mxfp4_experts(xx, iv.long(), lv[w13], lv[s13], lv[w2], lv[s2], beta, lb)
                if semantic.close(yv.float(), ref.float(), 3e-2, 3e-2 * float(ref.abs().max())):
                    return ExpertsSite(y, x, ids, w13, s13, w2, s2, beta, lb)
            return Fail(y, "the expert outputs differ from the MXFP4 experts of these codes and scales "
                           "(another layout, value table or activation)")
        got = semantic.evaluate([y], [x, ids], inputs, check, leaf_value=leaf_value)
        if not isinstance(got, Fail):
            return got
        why = got
    return why


def _latent_candidates(y: Node, ids: Node, m, L) -> list[Node]:
    """[M, L] model-dtype tensors behind y (nearest first), not through the ids."""
    out, seen, queue = [], {y, ids}, [y]
    while queue and len(seen) < 400:
        n = queue.pop(0)
        for a in n.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            s = shape(a)
            if s is not None and tuple(s) == (m, L) and val(a).dtype in (torch.bfloat16, torch.float16, torch.float32) \
                    and not is_call(a, *VIEW_OPS, *CONVERT_OPS):
                out.append(a)
                continue
            if a.op == "call_function":
                queue.append(a)
    return out


def _classify(leaves: list[Node], L, y: Node):
    """(w13, w13_scale, w2, w2_scale) among the region's uint8 graph inputs, by their K3 shapes."""
    u8 = [n for n in leaves if getattr(val(n), "dtype", None) == torch.uint8 and len(shape(n) or ()) == 3]
    if len(u8) != 4:
        return Fail(y, f"the experts read {len(u8)} uint8 [E, N, K] weights, expected 4 (w13, its scales, w2, its "
                       "scales)")
    by = {tuple(shape(n)): n for n in u8}
    for w13 in u8:
        E, two_i, half_l = shape(w13)
        if half_l * 2 != L or two_i % 2:
            continue
        i = two_i // 2
        got = by.get((E, two_i, L // 32)), by.get((E, L, i // 2)), by.get((E, L, i // 32))
        if all(g is not None for g in got) and len({w13, *got}) == 4:
            return w13, got[0], got[1], got[2]
    return Fail(y, "the uint8 weights are not w13 [E, 2I, L/2] + [E, 2I, L/32] and w2 [E, L, I/2] + [E, L, I/32]")


def _is_aten(n: Node) -> bool:
    t = n.target
    return (isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and t.namespace in ("aten", "prims")) \
        or t is operator.getitem


def _attr(n: Node):
    obj = n.graph.owning_module
    for part in n.target.split("."):
        obj = getattr(obj, part, None)
    return obj.detach().cpu() if isinstance(obj, torch.Tensor) else Fail(n, f"constant {n.target} has no value")
