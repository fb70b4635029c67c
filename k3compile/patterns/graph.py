"""Small recognisers over post-grad ATen FX graphs, shared by all K3 patterns.

Each `match_*` returns a dataclass describing the site, or a `Fail(node, reason)` saying at
which node matching stopped and why; the passes turn Fails into near-miss report lines.
They accept the forms the same math takes however a model was written: `F.linear` vs
`matmul`/`mm`/`addmm` with transposes, hand-written vs `F.rms_norm`, views around everything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Node
from torch.fx.node import map_aggregate

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.alias.default,
    aten.clone.default, aten.contiguous.default,
}
CONVERT_OPS = {prims.convert_element_type.default, aten._to_copy.default}


@dataclass
class Fail:
    node: Any
    reason: str

    def __bool__(self) -> bool:  # a Fail is falsy, so `if not m:` reads naturally
        return False


class NoSite(Fail):
    """A site the roles imply in a form no K3 op takes (a part inside another project's opaque op, a
    mixer with no output norm): a near-miss with its reason that does not count towards the pass's
    expected sites (`K3Pass.collect`)."""


def is_call(n: Any, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and (not targets or n.target in targets)


def val(n: Any):
    return n.meta.get("val") if isinstance(n, Node) else None


def shape(n: Any) -> tuple | None:
    v = val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(n: Any) -> torch.dtype | None:
    v = val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def strip(n: Any, views: bool = True, converts: bool = False) -> Any:
    """Walk up through view-like (and optionally dtype-convert) nodes."""
    ops = (VIEW_OPS if views else set()) | (CONVERT_OPS if converts else set())
    while is_call(n) and n.target in ops:
        n = n.args[0]
    return n


def strip_converts(n: Any) -> Any:
    return strip(n, views=False, converts=True)


def is_weight_like(n: Any) -> bool:
    """A graph input (parameter/buffer lifted as placeholder) or a get_attr, through views/converts."""
    n = strip(n, converts=True)
    return isinstance(n, Node) and n.op in ("placeholder", "get_attr")


def scalar(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


# ------------------------------------------------------------------------------------------ linear
@dataclass
class LinearSite:
    out: Node            # the node whose value is x @ W.T (+ residual/bias)
    x: Node              # activation [N, in]
    w: Node              # weight node as stored
    w_layout: str        # "out_in" (F.linear layout: W) or "in_out" (matmul layout: W.T stored)
    residual: Node | None = None  # addmm's 2-D additive input (Inductor folds `+ residual` into addmm)
    bias: Node | None = None      # addmm's 1-D bias
    nodes: list = field(default_factory=list)


def _weight_of(b: Node):
    """b is the right operand of mm: permute(W, [1, 0]) / t(W) -> (W, out_in), else (b, in_out)."""
    bs = strip(b, views=False, converts=False)
    if is_call(bs, aten.permute.default) and list(bs.args[1]) in ([1, 0], [-1, -2], [-1, 0], [1, -2]):
        return bs.args[0], "out_in"
    if is_call(bs, aten.t.default) or (is_call(bs, aten.transpose.int) and sorted(bs.args[1:3]) in ([0, 1], [-2, -1])):
        return bs.args[0], "out_in"
    return bs, "in_out"


weight_of = _weight_of


def match_linear(n: Any) -> LinearSite | Fail:
    """n (after views) is mm(x, W^T) / addmm(c, x, W^T) / bmm-free 2-D matmul."""
    m = strip(n)
    if is_call(m, aten.mm.default):
        x, b = m.args
        w, layout = _weight_of(b)
        return LinearSite(out=n, x=x, w=w, w_layout=layout, nodes=[m])
    if is_call(m, aten.addmm.default):
        c, x, b = m.args[:3]
        if m.kwargs.get("beta", 1) != 1 or m.kwargs.get("alpha", 1) != 1:
            return Fail(m, "addmm with alpha/beta != 1")
        w, layout = _weight_of(b)
        cs = shape(c)
        site = LinearSite(out=n, x=x, w=w, w_layout=layout, nodes=[m])
        if cs is not None and len(cs) == 1:
            site.bias = c
        else:
            site.residual = c
        return site
    return Fail(m, f"not a GEMM (found {_name(m)})")


def weight_out_in(graph, site: LinearSite, before: Node) -> Node:
    """A node holding W in F.linear [out, in] layout (inserting a transpose view if needed)."""
    if site.w_layout == "out_in":
        return site.w
    with graph.inserting_before(before):
        t = graph.call_function(aten.permute.default, (site.w, [1, 0]))
    v = val(site.w)
    if v is not None:
        t.meta["val"] = v.permute(1, 0)
    return t


# ------------------------------------------------------------------------------------------ collectives
@dataclass
class AllReduceSite:
    out: Node
    inp: Node
    group: str
    nodes: list


def match_all_reduce(n: Any) -> AllReduceSite | Fail:
    """n (after views) is wait_tensor(all_reduce(x, 'sum', group))."""
    w = strip(n)
    if not is_call(w, c10d.wait_tensor.default):
        return Fail(w, f"not an all-reduce (found {_name(w)})")
    ar = w.args[0]
    if not is_call(ar, c10d.all_reduce.default):
        return Fail(ar, f"wait_tensor of {_name(ar)}, not of all_reduce")
    if ar.args[1] != "sum":
        return Fail(ar, f"all_reduce op is {ar.args[1]!r}, not 'sum'")
    return AllReduceSite(out=n, inp=ar.args[0], group=ar.args[2], nodes=[w, ar])


def find_all_reduces(graph) -> list[AllReduceSite]:
    out = []
    for n in graph.nodes:
        if is_call(n, c10d.wait_tensor.default):
            m = match_all_reduce(n)
            if m:
                out.append(m)
    return out


# ------------------------------------------------------------------------------------------ RMSNorm
@dataclass
class RmsNormSite:
    out: Node            # the final node (after the cast back, if any)
    x: Node              # the input, before the fp32 cast
    weight: Node | None
    eps: float
    nodes: list
    # the rounding order the graph computes (ops.reference.NORM_* bits): NORM_CAST_FIRST where the
    # normalised x is rounded to a 16-bit dtype before the weight multiply; NORM_DIV / NORM_RECIP for
    # x / sqrt(...) and x * reciprocal(sqrt(...)); NORM_IN_DTYPE where the normalisation itself is in a
    # 16-bit dtype (0: x * rsqrt(...) in fp32, the weight applied in fp32, one rounding)
    rounding: int = 0


_LOW = (torch.bfloat16, torch.float16)
# ops.reference's NORM_* bits (importing them would import the ops here: the values are fixed)
_NORM_CAST_FIRST, _NORM_DIV, _NORM_RECIP, _NORM_IN_DTYPE = 1, 2, 4, 8


def norm_rounding_text(rounding: int) -> str:
    """A norm's rounding bits in words (for near-miss reasons and notes)."""
    words = []
    if rounding & _NORM_IN_DTYPE:
        words.append("normalised in the 16-bit input dtype")
    elif rounding & _NORM_CAST_FIRST:
        words.append("rounded to the input dtype before the weight multiply")
    if rounding & _NORM_DIV:
        words.append("x / sqrt(...)")
    elif rounding & _NORM_RECIP:
        words.append("x * reciprocal(sqrt(...))")
    return ", ".join(words) or "x * rsqrt(...) in fp32, the weight applied in fp32"


def rounded_between(top: Any, bottom: Any) -> bool:
    """Whether the chain of dtype casts from `top` down to `bottom` (top = converts of bottom) passes
    through a 16-bit float dtype: the value is rounded on the way."""
    n = top
    while is_call(n) and n.target in CONVERT_OPS and n is not bottom:
        if dtype(n) in _LOW:
            return True
        n = n.args[0]
    return False


def _match_mean_sq_eps(a: Any, xf: Node) -> float | Fail:
    """a == mean(xf^2, -1, keepdim) + eps with a constant eps; returns eps."""
    if is_call(a, aten.add.Tensor) and isinstance(a.args[1], Node) and is_weight_like(a.args[1]) \
            and len(shape(a.args[1]) or ()) == 0:
        return Fail(a, "RMSNorm eps is a traced graph input, not a constant: dynamo made the float dynamic "
                       "(dynamic=True); compile with dynamic=None (automatic dynamic shapes) or set "
                       "torch._dynamo.config.specialize_float=True")
    if not is_call(a, aten.add.Tensor, aten.add.Scalar) or scalar(a.args[1]) is None:
        return Fail(a, "expected `mean(x^2) + eps` with a constant eps")
    mean = a.args[0]
    if not (is_call(mean, aten.mean.dim) and list(mean.args[1]) in ([-1], [len(shape(xf) or [0]) - 1])):
        return Fail(mean, f"expected mean over the last dim, found {_name(mean)}")
    sq = mean.args[0]
    if is_call(sq, aten.pow.Tensor_Scalar) and sq.args[1] == 2:
        base = sq.args[0]
    elif is_call(sq, aten.mul.Tensor) and sq.args[0] is sq.args[1]:
        base = sq.args[0]
    else:
        return Fail(sq, f"expected x^2, found {_name(sq)}")
    if strip_converts(base) is not strip_converts(xf):
        return Fail(sq, "the squared tensor is not the normalised one")
    return scalar(a.args[1])


def _match_inv_rms(r: Any, xf: Node, form: list | None = None) -> float | Fail:
    """r == rsqrt(mean(xf^2, -1, keepdim) + eps) in one of its spellings; returns eps (and appends
    the spelling's NORM_* bit to `form`: 0 for rsqrt, NORM_RECIP for reciprocal(sqrt))."""
    r = strip(r, views=False)
    if is_call(r, aten.mul.Tensor) and 1.0 in [scalar(a) for a in r.args]:   # `1.0 / sqrt(...)`, decomposed
        r = strip(next(a for a in r.args if isinstance(a, Node)), views=False)
    if is_call(r, aten.rsqrt.default):
        if form is not None:
            form.append(0)
        return _match_mean_sq_eps(r.args[0], xf)
    if is_call(r, aten.reciprocal.default) and is_call(r.args[0], aten.sqrt.default):
        if form is not None:
            form.append(_NORM_RECIP)
        return _match_mean_sq_eps(r.args[0].args[0], xf)
    return Fail(r, f"expected rsqrt(mean(x^2) + eps), found {_name(r)}")


def match_rms_norm(n: Any) -> RmsNormSite | Fail:
    """n is RMSNorm(x) [* weight], possibly wrapped in dtype casts."""
    out = n
    m = strip_converts(n)
    nodes = [n]
    weight = None
    cast_first = 0
    if not is_call(m, aten.mul.Tensor, aten.div.Tensor):
        return Fail(m, f"not an RMSNorm (found {_name(m)})")
    # y * weight: one operand is a 1-D weight-like tensor
    if is_call(m, aten.mul.Tensor):
        for i in (0, 1):
            o = m.args[i]
            s = shape(o)
            if isinstance(o, Node) and s is not None and len(s) == 1 and (is_weight_like(o) or s == shape(m)[-1:]):
                other = m.args[1 - i]
                if is_call(strip_converts(other), aten.mul.Tensor, aten.div.Tensor):
                    weight, m = strip_converts(o), strip_converts(other)
                    nodes.append(m)
                    # `weight * h.to(dtype)`: the normalised x rounded before the weight multiply
                    cast_first = _NORM_CAST_FIRST if rounded_between(other, m) else 0
                break
    # x * rsqrt(...) or x / sqrt(...)
    if is_call(m, aten.mul.Tensor):
        a, b = m.args
        for xf, r in ((a, b), (b, a)):
            if isinstance(r, Node) and (shape(r) or (None,))[-1] == 1:
                form: list = []
                eps = _match_inv_rms(r, xf, form)
                if isinstance(eps, Fail):
                    return eps
                low = _NORM_IN_DTYPE if dtype(m) in _LOW else cast_first
                return RmsNormSite(out, strip_converts(xf), weight, eps, nodes, low | form[0])
        return Fail(m, "mul is not x * rsqrt(mean(x^2) + eps)")
    if is_call(m, aten.div.Tensor) and is_call(m.args[1], aten.sqrt.default):
        xf, sq = m.args
        eps = _match_mean_sq_eps(sq.args[0], xf)
        if isinstance(eps, Fail):
            return eps
        low = _NORM_IN_DTYPE if dtype(m) in _LOW else cast_first
        return RmsNormSite(out, strip_converts(xf), weight, eps, nodes, low | _NORM_DIV)
    return Fail(m, f"not an RMSNorm (found {_name(m)})")


def why_not_rms_norm(x: Node) -> str | None:
    """If `x` feeds something that starts like an RMSNorm but does not match, say why."""
    for p in x.users:
        q = p if is_call(p, aten.pow.Tensor_Scalar) else next((u for u in p.users if is_call(u, aten.pow.Tensor_Scalar)), None)
        if q is None or strip_converts(q.args[0]) is not x:
            continue
        for mean in q.users:
            for add in mean.users:
                for r in add.users:
                    res = _match_inv_rms(r, q.args[0])
                    if isinstance(res, Fail):
                        return res.reason
    return None


def rms_norms_by_input(graph) -> dict[Node, list[RmsNormSite]]:
    """Every RMSNorm in the graph, keyed by its input node (outermost cast node kept as `out`)."""
    found: dict[Node, list[RmsNormSite]] = {}
    seen: set = set()
    for n in reversed(list(graph.nodes)):
        if n in seen or not is_call(n):
            continue
        site = match_rms_norm(n)
        if site:
            found.setdefault(site.x, []).append(site)
            seen.update(site.nodes)
            # the inner nodes of this norm are not separate norms
            inner = strip_converts(n)
            seen.add(inner)
    return found


# ------------------------------------------------------------------------------------------ helpers
_COLLECTIVES = (c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)


def orphan_collectives(graph) -> set[Node]:
    """Functional collectives whose only users are `wait_tensor` nodes that nobody uses. FX's
    dead-code elimination keeps them (collectives count as side effects), so a rewrite that takes
    over a collective's consumers leaves it, and the GEMM feeding it, running for nothing."""
    out = set()
    for n in graph.nodes:
        if is_call(n, *_COLLECTIVES) and n.users and all(
                is_call(u, c10d.wait_tensor.default) and not u.users for u in n.users):
            out.add(n)
    return out


def erase_collectives(graph, nodes) -> None:
    """Erase these collectives and their unused waits; the caller's DCE then drops their inputs."""
    for n in nodes:
        for u in list(n.users):
            graph.erase_node(u)
        graph.erase_node(n)


def _name(n: Any) -> str:
    if is_call(n):
        t = n.target
        return f"{getattr(t, '__name__', str(t))} ({n.name})"
    if isinstance(n, Node):
        return f"{n.op} {n.name}"
    return repr(n)


def describe(n: Any) -> str:
    return _name(n)



# ------------------------------------------------------------------------------------------ view chains
def concrete(a: Any) -> int | None:
    """An int for a size: an int, a SymInt or a node holding one (its hint: the example value the
    graph was traced with); None where there is none."""
    v = a.meta.get("val") if isinstance(a, Node) else a
    if isinstance(v, torch.SymInt):
        return v.node.hint if isinstance(v.node.hint, int) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def replays_to(chain: list, shape_: tuple, want) -> bool:
    """Whether the view nodes `chain` (each reading the one before) turn an index tensor of
    `shape_` into want(it): replayed on real tensors, symbolic sizes at their example values."""
    dims = [concrete(d) for d in shape_]
    if None in dims:
        return False
    with unset_fake_temporarily():  # real tensors: the passes run under the graph's fake mode
        probe = torch.arange(int(torch.tensor(dims).prod()), dtype=torch.float64).view(*dims)
        v = probe
        try:
            for c in chain:
                args = map_aggregate(c.args[1:], lambda a: concrete(a) if isinstance(a, Node) else a)
                leaves: list = []
                map_aggregate(args, leaves.append)
                if None in leaves:    # a size with no example value
                    return False
                v = c.target(v, *args, **c.kwargs)
        except Exception:  # noqa: BLE001 - a chain this replay cannot follow is simply not taken
            return False
        w = want(probe)
        return v.shape == w.shape and torch.equal(v, w)
