"""The AttnRes post-norm that follows a residual add (spec section 2, "Mixer").

Two forms, both starting from `updated` (= prefix + delta):
- no blocks: `RMSNorm(updated) * g`;
- n blocks:  `RMSNorm(sum_s softmax_s(sum_d RMSNorm(src_s) * w_norm * w_qk) * src_s) * g` over
  srcs = stack([blocks..., updated]) (post-grad: stack, or cat + reshape; softmax decomposed or not, or
  in the online form Inductor gives it on CUDA: prims.prepare_softmax_online).

`match_attnres_from_norm` parses that reference spelling structurally first (`_match_stacked`); any
other spelling (weights applied inside the key RMSNorm, an einsum, sources in a preallocated buffer,
an unrolled loop with a running max, ...) is found by role and verified by evaluation
(`_match_general`): the region of the graph between the final norm's input and the [M, H] sources
it normalises is run on random CPU tensors and compared with the spec's formula.

A site also records how the mixer rounds (`mix_rounding`, ops/reference.py's MIX_* bits: keys rounded to
the model dtype or kept in fp32, a key RMSNorm with its own weight, softmax or an unrolled sum), and its
final norm how that norm rounds (`norm.rounding`): the fused ops follow both, so a rewritten graph
equals the model's own in bf16 (the orders differ by up to a bf16 rounding of every element, which
the next layers amplify).
"""
from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Node
from torch.fx.node import map_aggregate

from ..ops import reference as ref
from .graph import (CONVERT_OPS, VIEW_OPS, Fail, RmsNormSite, aten, concrete, describe, dtype, is_call, match_rms_norm,
                    rounded_between, scalar, shape, strip, strip_converts, val, _name)
from .attnres_eval import _LOW_PRECISION, _evaluate, _mix_rounding, _order_weights, _replay, _sig  # noqa: F401


@dataclass
class AttnResSite:
    norm: RmsNormSite   # the final RMSNorm (its .out is the mixer's output, .weight is g)
    updated: Node
    blocks: list        # block nodes, oldest first ([] for the plain RMSNorm form)
    w_norm: Node | None
    w_qk: Node | None
    # "post_norm": the norm after a mixer / a residual add (or any plain RMSNorm; `updated` is then
    # its input, whatever that is). "key_norm": the norm is one of a mixer's per-source key norms
    # (an unrolled mixer normalises each source, the residual add among them, on its own): it is
    # not a residual norm site, and `updated` is None.
    role: str = "post_norm"
    # how the mixer rounds its logits and weighted sum (ops.reference.MIX_* bits; 0 without blocks):
    # read from the graph's structure on the reference spelling, else found by evaluating the region
    # (the spelling whose reference reproduces it bit for bit). The output norm's order: norm.rounding.
    mix_rounding: int = 0


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


def _match_stacked(norm: RmsNormSite) -> AttnResSite | Fail | None:
    """The structural fast path: the mixer as the reference model writes it (a sum over stacked
    sources of softmax weights times the sources). None where the norm's input is not such a sum."""
    mixed = strip_converts(norm.x)
    if not is_call(mixed, aten.sum.dim_IntList) or list(mixed.args[1]) != [0]:
        return None
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
    if src_norm.eps != norm.eps:
        return Fail(inner, f"the mixer's key RMSNorm eps {src_norm.eps:g} differs from its output norm's "
                           f"{norm.eps:g}: the fused ops take one eps")
    srcs = _sources(srcs_node)
    # the keys: rounded to the model dtype before the dot product with w_norm * w_qk, or kept in fp32
    mr = src_norm.rounding | (0 if rounded_between(inner, strip_converts(inner)) else ref.MIX_KEY_FP32)
    # the mixed row: rounded to the sources' dtype before the output norm, or normalised in fp32 (vLLM)
    xf = next((a for a in norm.nodes[-1].args if isinstance(a, Node) and strip_converts(a) is mixed), None)
    if (xf is not None and dtype(mixed) == torch.float32 and dtype(srcs[-1]) in _LOW_PRECISION
            and not rounded_between(xf, mixed)):
        mr |= ref.MIX_SUM_FP32
    return AttnResSite(norm, srcs[-1], srcs[:-1], w_norm, w_qk, mix_rounding=mr)


# ------------------------------------------------------------------------------------------ any spelling
def match_attnres_from_norm(norm: RmsNormSite) -> AttnResSite | Fail:
    """Given the final RMSNorm, recognise what feeds it: `updated` directly or the mixer.

    The reference spelling is parsed structurally (`_match_stacked`); any other one is found by role
    and verified by evaluation (`_match_general`). A norm whose input is no mixer is the plain form:
    `updated` is its input, whatever that is (the callers take it only where it is a residual add),
    except a per-source key norm of an unrolled mixer (role "key_norm", `updated` None)."""
    site = _match_any(norm)
    if isinstance(site, AttnResSite) and site.updated is not None:
        site.norm = _inner_out(site.norm, site.updated)
    return site


def _match_any(norm: RmsNormSite) -> AttnResSite | Fail:
    fast = _match_stacked(norm)
    if isinstance(fast, AttnResSite):
        return fast
    found = _find_mixer(norm.x)
    if found is not None:
        return _verify(norm, found)
    if isinstance(fast, Fail):
        return fast
    if _is_residual_add(norm.x) and _inside_mixer(norm):
        return AttnResSite(norm, None, [], None, None, role="key_norm")
    return AttnResSite(norm, norm.x, [], None, None)


def _inner_out(norm: RmsNormSite, updated: Node) -> RmsNormSite:
    """The norm with its output taken at the innermost cast in the residual stream's dtype: where a
    consumer upcasts the output (`F.linear(x.float(), W.float())`), the site found at the upcast
    would otherwise be rewritten there, leaving the other consumers on the unfused mixer."""
    want = val(updated).dtype if isinstance(val(updated), torch.Tensor) else None
    n, pick = norm.out, None
    while is_call(n):
        if getattr(val(n), "dtype", None) == want:
            pick = n
        if n.target not in CONVERT_OPS:
            break   # the norm's last op (its weight mul): a candidate too, then stop
        n = n.args[0]
    if pick is None or pick is norm.out:
        return norm
    return RmsNormSite(pick, norm.x, norm.weight, norm.eps, [pick] + [x for x in norm.nodes if x is not norm.out],
                       norm.rounding)


# How far the walks go (nodes): a mixer over 9 sources written as an unrolled loop is about 250
# nodes; the backward walk may also run down the residual stream's chain of adds (one add and a
# GEMM output per layer) before it ends at GEMMs, collectives and graph inputs.
_WALK_BUDGET = 4000
_REGION_BUDGET = 1500
_FORWARD_BUDGET = 600

_GEMMS = {aten.mm.default, aten.bmm.default, aten.mv.default, aten.addmm.default, aten.baddbmm.default,
          aten.dot.default, aten.matmul.default}
# not pointwise-tagged, but what a mixer's math is made of (besides pointwise ops, converts and views)
_REGION_OPS = {
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
    aten.amin.default, aten.max.dim, aten.logsumexp.default, aten.prod.dim_int,
    aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
    aten.permute.default, aten.expand.default, aten.t.default, aten.transpose.int, aten.slice.Tensor,
    aten.select.int, aten.narrow.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.cat.default, aten.stack.default, aten.select_scatter.default,
    aten.slice_scatter.default, aten.copy.default, aten.full.default, aten.scalar_tensor.default,
    aten.zeros.default, aten.ones.default, aten.full_like.default, aten.zeros_like.default,
    aten.ones_like.default, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
}


def _exp_ops() -> set:
    ops = {aten.exp.default, aten.exp2.default, aten._softmax.default, aten.softmax.int}
    online = getattr(torch.ops.prims, "prepare_softmax_online", None)   # registered by Inductor
    if online is not None:
        ops.add(online.default)
    return ops


def _is_weight_matrix(a: Any) -> bool:
    """a is a graph input / get_attr of 2+ dims (through views, converts and transposes): a GEMM
    reading it is a projection, where a mixer's region ends."""
    while is_call(a) and (a.target in VIEW_OPS or a.target in CONVERT_OPS or a.target in (
            aten.permute.default, aten.t.default, aten.transpose.int, aten.expand.default)):
        a = a.args[0]
    return isinstance(a, Node) and a.op in ("placeholder", "get_attr") and len(shape(a) or ()) >= 2


def _expandable(n: Any) -> bool:
    """Whether a walk goes through n: elementwise math, reductions, layout ops, softmax, GEMMs of
    activations (einsum); not projections, collectives, custom ops or graph inputs."""
    if not is_call(n):
        return False
    t = n.target
    if t is operator.getitem or t in _REGION_OPS or t in CONVERT_OPS or t in VIEW_OPS:
        return True
    if t in _GEMMS:
        return not any(_is_weight_matrix(a) for a in n.args[:3])
    if t in _exp_ops():
        return True
    return torch.Tag.pointwise in getattr(t, "tags", ())


def _squared(n: Any) -> Node | None:
    """x where n is x^2 (pow or x * x): what a mean-of-squares normalises."""
    if is_call(n, aten.pow.Tensor_Scalar) and n.args[1] == 2 and isinstance(n.args[0], Node):
        return n.args[0]
    if is_call(n, aten.mul.Tensor) and isinstance(n.args[0], Node) and n.args[0] is n.args[1]:
        return n.args[0]
    return None


def _canon(n: Any) -> Any:
    """n through dtype casts, shape-keeping views and copies into a same-shaped buffer slot."""
    while is_call(n):
        t = n.target
        if t in CONVERT_OPS or (t in VIEW_OPS and _sig(n.args[0]) == _sig(n)):
            n = n.args[0]
        elif t is aten.copy.default and _sig(n.args[1]) == _sig(n):
            n = n.args[1]
        else:
            break
    return n


def _is_residual_add(n: Any) -> bool:
    """n = prefix + delta of two same-shaped tensors (or Inductor's addmm(prefix, h, W^T) at TP=1)."""
    if is_call(n, aten.add.Tensor) and len(n.args) >= 2:
        a, b = n.args[:2]
        return (isinstance(a, Node) and isinstance(b, Node) and _sig(n) is not None and _sig(a) == _sig(b) == _sig(n)
                and len(_sig(n)) == 2)
    if is_call(n, aten.addmm.default):
        return isinstance(n.args[0], Node) and len(shape(n.args[0]) or ()) == 2
    return False


def _int(a: Any) -> int | None:
    return concrete(a)


def _slice_of(n: Node, first: int) -> slice | None:
    """The Python slice of aten.slice / slice_scatter's (start, end, step) at args[first:]; None where
    a bound has no example value."""
    names = ("start", "end", "step")
    got = [n.args[first + i] if len(n.args) > first + i else n.kwargs.get(k, 1 if k == "step" else None)
           for i, k in enumerate(names)]
    out = [None if a is None else _int(a) for a in got]
    if any(o is None and a is not None for o, a in zip(out, got)) or out[2] is None:
        return None
    return slice(*out)


def _slots(t: Node, ms: tuple, depth: int = 0) -> list:
    """The [M, H] sources stacked (along dim 0) in t, [S, M, H]: nodes, or a Fail for a slot no
    [M, H] node holds (a buffer slot read from a graph input)."""
    n = t
    while is_call(n) and (n.target in CONVERT_OPS or (n.target in VIEW_OPS and _sig(n.args[0]) == _sig(n))):
        n = n.args[0]
    s = _sig(n)
    count = _int(shape(n)[0]) if s else None

    def unresolved():
        return [Fail(n, f"AttnRes source slot {i} of {describe(t)} is read from {describe(n)}: no [M, H] node "
                        "holds it") for i in range(count or 1)]

    def dim0(i):
        d = n.args[i] if len(n.args) > i else n.kwargs.get("dim", 0)
        return d in (0, -len(s))

    if depth > 64 or s is None:
        return unresolved()
    if is_call(n, aten.stack.default) and dim0(1):
        return [_canon(x) for x in n.args[0]]
    if is_call(n, aten.cat.default) and dim0(1):
        out = []
        for x in n.args[0]:
            sx = _sig(x)
            if is_call(x, aten.unsqueeze.default) and x.args[1] == 0 and _sig(x.args[0]) == ms:
                out.append(_canon(x.args[0]))
            elif sx is not None and sx[1:] == ms and len(sx) == len(ms) + 1:
                out.extend(_slots(x, ms, depth + 1))
            else:
                return unresolved()
        return out
    if is_call(n, aten.view.default, aten.reshape.default, aten._unsafe_view.default) and s[1:] == ms:
        u = n.args[0]
        while is_call(u) and (u.target in CONVERT_OPS or (u.target in VIEW_OPS and _sig(u.args[0]) == _sig(u))):
            u = u.args[0]
        if is_call(u, aten.cat.default) and (len(u.args) < 2 or u.args[1] == 0) and all(
                _sig(x) == ms for x in u.args[0]):   # cat([M, H] sources) viewed as [S, M, H]
            return [_canon(x) for x in u.args[0]]
        return unresolved()
    if is_call(n, aten.slice.Tensor) and dim0(1):
        sl = _slice_of(n, 2)
        return unresolved() if sl is None else _slots(n.args[0], ms, depth + 1)[sl]
    if is_call(n, aten.select_scatter.default) and n.args[2] in (0, -len(s)):
        base = list(_slots(n.args[0], ms, depth + 1))
        i = _int(n.args[3])
        if i is None or not -len(base) <= i < len(base) or _sig(n.args[1]) != ms:
            return unresolved()
        base[i] = _canon(n.args[1])
        return base
    if is_call(n, aten.slice_scatter.default) and (n.args[2] if len(n.args) > 2 else 0) in (0, -len(s)):
        base = list(_slots(n.args[0], ms, depth + 1))
        sl = _slice_of(n, 3)
        part = _slots(n.args[1], ms, depth + 1)
        if sl is None or len(range(*sl.indices(len(base)))) != len(part):
            return unresolved()
        base[sl] = part
        return base
    if is_call(n, aten.copy.default) and _sig(n.args[1]) == s:
        return _slots(n.args[1], ms, depth + 1)
    return unresolved()


@dataclass
class _Found:
    """A mixer found by role: the region between the final norm's input and what it reads."""
    mixed: Node
    region: list          # the region's nodes, in a topological order (mixed last)
    leaves: dict          # node read by the region -> ("src" | "alias", source) / ("stack", [slots]) /
                          # ("weight", None) / ("size", int) / ("const", tensor)
    sources: list         # distinct [M, H] sources, graph order
    updated: Node
    weights: list
    foreign: list
    unresolved: list


def _find_mixer(mixed: Any) -> _Found | None:
    """The AttnRes mixer whose output is `mixed`, found by role, or None where `mixed` is no mixer.

    Role: the sources are the [M, H] tensors (mixed's shape) the region RMS-normalises (their
    squares are averaged), one at a time or stacked into [S, M, H] (stack, cat, a buffer's slots);
    the region is everything between them and `mixed`; it must contain a softmax (an exp), read
    at least two sources, and the newest residual add among them is `updated`. Whether it computes
    the spec's formula is `_verify`'s business."""
    if not _expandable(mixed):
        return None
    ms = _sig(mixed)
    if ms is None or len(ms) < 2:
        return None
    # 1. candidates: what the region squares (walk back through mixer-like ops only)
    singles, stacked = {}, {}
    seen, todo = {mixed}, deque([mixed])
    while todo:
        n = todo.popleft()
        x = _squared(n)
        if x is not None:
            c = _canon(x)
            sc = _sig(c)
            if sc == ms:
                singles[c] = None
            elif sc is not None and len(sc) == len(ms) + 1 and sc[1:] == ms:
                stacked[c] = None
        for a in n.all_input_nodes:
            if a not in seen and len(seen) < _WALK_BUDGET:
                seen.add(a)
                if _expandable(a):
                    todo.append(a)
    if not singles and not stacked:
        return None
    slots = {t: _slots(t, ms) for t in stacked}
    src_set = set(singles) | {x for sl in slots.values() for x in sl if isinstance(x, Node)}
    # 2. the region: from mixed back to the sources; everything else it reads is a leaf
    hdim = ms[-1:]
    leaves: dict = {}
    weights, foreign = [], []
    region, visited = [], {mixed}
    stack = [(mixed, iter(mixed.all_input_nodes))]
    while stack:
        n, it = stack[-1]
        for a in it:
            if a in visited:
                continue
            visited.add(a)
            if len(visited) > _REGION_BUDGET:
                return None
            if a in stacked:
                leaves[a] = ("stack", slots[a])
            elif a in src_set:
                leaves[a] = ("src", a)
            elif _canon(a) in src_set:
                leaves[a] = ("alias", _canon(a))
            elif (again := _restacks(a, ms, src_set)) is not None:   # the sources stacked again (another slice)
                leaves[a] = ("stack", again)
            elif not isinstance(val(a), torch.Tensor) and concrete(a) is not None:
                leaves[a] = ("size", concrete(a))
            elif a.op in ("placeholder", "get_attr") and _sig(a) == hdim:
                leaves[a] = ("weight", None)
                weights.append(a)
            elif (const := _constant(a)) is not None:
                leaves[a] = ("const", const)
            elif _expandable(a):
                stack.append((a, iter(a.all_input_nodes)))
                break
            else:
                foreign.append(a)
        else:
            stack.pop()
            region.append(n)
    exps = _exp_ops()
    if not any(n.target in exps for n in region):
        return None
    sources, unresolved = {}, []
    for kind, v in leaves.values():
        for x in (v if kind == "stack" else [v] if kind in ("src", "alias") else []):
            if isinstance(x, Fail):
                unresolved.append(x)
            else:
                sources[x] = None
    ordered = sorted(sources, key=lambda n: n._sort_key) if all(hasattr(n, "_sort_key") for n in sources) else \
        list(sources)
    adds = [s for s in ordered if _is_residual_add(s)]
    if len(ordered) + len(unresolved) < 2 or not adds:
        return None
    return _Found(mixed, region, leaves, ordered, adds[-1], weights, foreign, unresolved)


def _constant(a: Node) -> torch.Tensor | None:
    """The real tensor a get_attr node holds (a lifted constant), where the graph's module has one."""
    if a.op != "get_attr":
        return None
    obj = a.graph.owning_module
    try:
        for part in str(a.target).split("."):
            obj = getattr(obj, part)
    except AttributeError:
        return None
    from torch._subclasses.fake_tensor import FakeTensor
    return obj if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) and obj.numel() <= 1 << 16 else None


def _restacks(a: Node, ms: tuple, src_set: set) -> list | None:
    """a's slots where a is an [S, M, H] stack of known sources only, else None."""
    sa = _sig(a)
    if sa is None or len(sa) != len(ms) + 1 or sa[1:] != ms:
        return None
    sl = _slots(a, ms)
    return sl if sl and all(isinstance(x, Node) and x in src_set for x in sl) else None


def _inside_mixer(norm: RmsNormSite) -> bool:
    """Whether this norm (of a residual add) is a key norm inside a mixer: a mixer found downstream
    (within a short forward walk) has it in its region."""
    mine = {norm.out, *norm.nodes}
    xs = _sig(norm.x)
    seen, todo, tried = {norm.out}, deque([norm.out]), set()
    while todo:
        n = todo.popleft()
        for u in n.users:
            if u in seen or len(seen) >= _FORWARD_BUDGET:
                continue
            seen.add(u)
            if not _expandable(u):
                continue
            todo.append(u)
            x = _squared(u)
            if x is None:
                continue
            c = strip_converts(x)
            if c in tried or _sig(c) != xs:
                continue
            tried.add(c)
            found = _find_mixer(c)
            if found is not None and any(m in mine for m in found.region):
                return True
    return False


def _verify(norm: RmsNormSite, f: _Found) -> AttnResSite | Fail:
    """f's region computes the spec's mixer over f.sources with its two [H] weights: an AttnResSite."""
    if f.unresolved:
        return f.unresolved[0]
    if f.foreign:
        return Fail(f.foreign[0], f"the AttnRes mixer's region (at {describe(f.mixed)}) reads {describe(f.foreign[0])}, "
                                  "neither a source [M, H] tensor nor an [H] weight"
                                  + (f" ({len(f.foreign)} such inputs)" if len(f.foreign) > 1 else ""))
    if len(f.weights) != 2:
        return Fail(f.mixed, f"the AttnRes mixer's region reads {len(f.weights)} [H] weight(s)"
                             f"{' (' + ', '.join(w.name for w in f.weights) + ')' if f.weights else ''}, expected 2 "
                             "(w_norm and w_qk)")
    eps = sorted({e for n in f.region if is_call(n, aten.add.Tensor, aten.add.Scalar)
                  for e in (scalar(a) for a in n.args[:2]) if e is not None and 0 < e <= 1e-2} | {norm.eps})
    for fp32 in (True, False):
        r = _evaluate(f, fp32, eps)
        if isinstance(r, Fail):
            return r
        err, tol, what = r
        if not err <= tol:
            return Fail(f.mixed, f"evaluated AttnRes mixer (at {describe(f.mixed)}, {len(f.sources)} sources) differs "
                                 f"from the spec formula by {err:.3g} (relative, {what}; tolerance {tol:g})")
    w_norm, w_qk = _order_weights(f)
    blocks = [s for s in f.sources if s is not f.updated]
    return AttnResSite(norm, f.updated, blocks, w_norm, w_qk,
                       mix_rounding=_mix_rounding(f, [*blocks, f.updated], w_norm, w_qk, norm.eps))
