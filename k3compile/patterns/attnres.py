"""The AttnRes post-norm that follows a residual add (spec section 2, "Mixer").

Two forms, both starting from `updated` (= prefix + delta):
- no blocks: `RMSNorm(updated) * g`;
- n blocks:  `RMSNorm(sum_s softmax_s(sum_d RMSNorm(src_s) * w_norm * w_qk) * src_s) * g` over
  srcs = stack([blocks..., updated]) (post-grad: stack, or cat + reshape; softmax decomposed or not, or
  in the online form Inductor gives it on CUDA: prims.prepare_softmax_online).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from .graph import Fail, RmsNormSite, aten, is_call, match_rms_norm, shape, strip, strip_converts, _name


@dataclass
class AttnResSite:
    norm: RmsNormSite   # the final RMSNorm (its .out is the mixer's output, .weight is g)
    updated: Node
    blocks: list        # block nodes, oldest first ([] for the plain RMSNorm form)
    w_norm: Node | None
    w_qk: Node | None


def _sources(t: Node) -> list | Fail:
    """t (after converts/views) stacks the sources along dim 0: returns them."""
    s = strip(strip_converts(t))
    if is_call(s, aten.stack.default) and (len(s.args) < 2 or s.args[1] == 0):
        return list(s.args[0])
    if is_call(s, aten.cat.default) and (len(s.args) < 2 or s.args[1] == 0):
        return [strip(x) if is_call(x, aten.unsqueeze.default) else x for x in s.args[0]]
    return Fail(s, f"mixer sources are not a stack along dim 0 (found {_name(s)})")


def _online_softmax_part(n: Any, x: Node, i: int) -> bool:
    """n is output i (0: max, 1: sum) of prims.prepare_softmax_online(x, 0): the form Inductor's
    post-grad pass gives a softmax on CUDA (config.online_softmax, post_grad.prepare_softmax_replacement)."""
    op = getattr(torch.ops.prims, "prepare_softmax_online", None)
    return (op is not None and is_call(n, operator.getitem) and n.args[1] == i and is_call(n.args[0], op.default)
            and n.args[0].args[0] is x and n.args[0].args[1] in (0, -2))


def _softmax_input(p: Node) -> Node | Fail:
    p = strip(p)
    if is_call(p, aten._softmax.default) and p.args[1] in (0, -2):
        return p.args[0]
    if is_call(p, aten.div.Tensor) and is_call(p.args[0], aten.exp.default):
        sub = p.args[0].args[0]
        if is_call(sub, aten.sub.Tensor) and is_call(sub.args[1], aten.amax.default) and list(sub.args[1].args[1]) == [0]:
            return sub.args[0]
        if (is_call(sub, aten.sub.Tensor) and _online_softmax_part(sub.args[1], sub.args[0], 0)
                and _online_softmax_part(p.args[1], sub.args[0], 1)):
            return sub.args[0]
    return Fail(p, f"mixing weights are not a softmax over the sources (found {_name(p)})")


def match_attnres_from_norm(norm: RmsNormSite) -> AttnResSite | Fail:
    """Given the final RMSNorm, recognise what feeds it: `updated` directly or the mixer."""
    mixed = strip_converts(norm.x)
    if not is_call(mixed, aten.sum.dim_IntList) or list(mixed.args[1]) != [0]:
        return AttnResSite(norm, norm.x, [], None, None)  # plain RMSNorm form
    prod = mixed.args[0]
    if not is_call(prod, aten.mul.Tensor):
        return Fail(prod, f"mixer: expected p * sources, found {_name(prod)}")
    srcs_node = p = None
    for a, b in ((prod.args[0], prod.args[1]), (prod.args[1], prod.args[0])):
        srcs = _sources(b)
        if not isinstance(srcs, Fail):
            srcs_node, p = b, a
            break
    if srcs_node is None:
        return Fail(prod, "mixer: neither operand of p * sources is the stacked sources")
    logits = _softmax_input(p)
    if isinstance(logits, Fail):
        return logits
    if not (is_call(logits, aten.sum.dim_IntList) and list(logits.args[1]) in ([-1], [2])):
        return Fail(logits, f"mixer logits are not a sum over the hidden dim (found {_name(logits)})")
    lm = strip_converts(logits.args[0])
    if not is_call(lm, aten.mul.Tensor):
        return Fail(lm, "mixer logits are not RMSNorm(sources) * w_norm * w_qk")
    w_norm = w_qk = None
    inner = None
    for a, b in ((lm.args[0], lm.args[1]), (lm.args[1], lm.args[0])):
        bb = strip_converts(b)
        if is_call(bb, aten.mul.Tensor) and len(shape(bb) or ()) == 1:
            w_norm, w_qk = strip_converts(bb.args[0]), strip_converts(bb.args[1])
            inner = a
            break
    if inner is None:
        return Fail(lm, "mixer logits: no w_norm * w_qk factor")
    src_norm = match_rms_norm(strip_converts(inner))
    if isinstance(src_norm, Fail):
        return Fail(inner, f"mixer logits: sources are not RMS-normalised ({src_norm.reason})")
    if strip(strip_converts(src_norm.x)) is not strip(strip_converts(srcs_node)):
        return Fail(inner, "mixer logits normalise a different tensor than the mixed sources")
    srcs = _sources(srcs_node)
    return AttnResSite(norm, srcs[-1], srcs[:-1], w_norm, w_qk)
