"""The KDA decode step's prologue, feeding `k3model::kda_decode` (K3-SPEC section 2, KDA):

    q    = [convert] (normalize(Xq) * scale)      normalize(x) = x / clamp_min(||x||_2, eps), per head
    k    = [convert]  normalize(Xk)
    g    = lower * sigmoid(exp(A_log)[h] * ([convert] F + dt_bias[h, :]))      F: the f_b GEMM's output
    beta = sigmoid([convert] B)

`match_kda_prologue(node)` takes the auto-functionalized kda_decode node and returns the raw inputs
(Xq, Xk, F, B, A_log, dt_bias and the constants), or a Fail naming the node where the chain differs
from this form. Post-grad ATen forms: the L2 norm is `pow(sum(pow(x, 2), [-1], keepdim), 0.5)` (or
`sqrt(sum(x * x))`), expanded back to x's shape; views and dtype converts are looked through.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from .graph import Fail, aten, describe, is_call, is_weight_like, scalar, shape, strip, strip_converts

_EXPANDS = {aten.expand.default}


@dataclass
class L2NormSite:
    x: Node          # the un-normalised input (below any view / convert the normalize added)
    eps: float
    scale: float     # the multiplier after the norm (1.0 if none)


@dataclass
class KdaPrologueSite:
    q: L2NormSite
    k: L2NormSite
    qk_dtype: torch.dtype    # what q and k were cast to for the recurrence
    f: Node                  # the gate's input [M, H, K] (before its fp32 cast)
    a_log: Node              # [H] parameter
    dt_bias: Node            # [H * K] or [H, K] parameter
    lower: float
    beta: Node               # the raw beta logits [M, H] (before their fp32 cast)


def _dtype_of(n: Any) -> torch.dtype | None:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


def _split_scalar_mul(n: Any) -> tuple[Any, float | None]:
    """(other operand, scalar) of mul(x, c) / mul(c, x); (n, None) otherwise."""
    if is_call(n, aten.mul.Tensor, aten.mul.Scalar):
        a, b = n.args[0], n.args[1]
        if scalar(b) is not None:
            return a, scalar(b)
        if scalar(a) is not None:
            return b, scalar(a)
    return n, None


def _norm_of(d: Any) -> tuple[Node, float] | Fail:
    """clamp_min(pow(sum(pow(x, 2), -1, keepdim), 0.5), eps) [expanded] -> (x, eps)."""
    d = strip(d)
    while is_call(d, *_EXPANDS):
        d = strip(d.args[0])
    if not is_call(d, aten.clamp_min.default) or scalar(d.args[1]) is None:
        return Fail(d, f"the L2 norm's denominator is not clamp_min(norm, eps) (found {describe(d)})")
    eps = scalar(d.args[1])
    r = strip(d.args[0])
    if is_call(r, aten.pow.Tensor_Scalar) and scalar(r.args[1]) == 0.5:
        s = strip(r.args[0])
    elif is_call(r, aten.sqrt.default):
        s = strip(r.args[0])
    else:
        return Fail(r, f"the L2 norm is not the square root of a sum of squares (found {describe(r)})")
    if not (is_call(s, aten.sum.dim_IntList) and list(s.args[1]) in ([-1], [len(shape(s) or ()) - 1])):
        return Fail(s, f"the L2 norm does not sum over the last dim (found {describe(s)})")
    sq = strip(s.args[0])
    if is_call(sq, aten.pow.Tensor_Scalar) and scalar(sq.args[1]) == 2.0:
        x = sq.args[0]
    elif is_call(sq, aten.mul.Tensor) and sq.args[0] is sq.args[1]:
        x = sq.args[0]
    else:
        return Fail(sq, f"the L2 norm does not square its input (found {describe(sq)})")
    return x, eps


def match_l2norm(n: Any, what: str) -> L2NormSite | Fail:
    """[convert] ([scale *] x / clamp_min(||x||, eps)) -> L2NormSite (x below the norm's own converts)."""
    n = strip_converts(n)
    inner, sc = _split_scalar_mul(n)
    inner = strip_converts(inner)
    if not is_call(inner, aten.div.Tensor):
        return Fail(inner, f"{what} is not L2-normalised: expected x / norm(x) (found {describe(inner)})")
    x = inner.args[0]
    m = _norm_of(inner.args[1])
    if isinstance(m, Fail):
        return m
    nx, eps = m
    if strip(strip_converts(nx)) is not strip(strip_converts(x)):
        return Fail(inner, f"{what}: the norm is taken of another tensor than the one it divides")
    x = strip_converts(x)
    if shape(x) is None or len(shape(x)) != 3:
        return Fail(inner, f"{what}: the normalised tensor is not [M, H, K] (shape {shape(x)})")
    return L2NormSite(x=x, eps=eps, scale=1.0 if sc is None else sc)


def match_gate(n: Any) -> tuple[Node, Node, Node, float] | Fail:
    """lower * sigmoid(exp(A_log)[view] * ([convert] F + dt_bias[view])) -> (F, A_log, dt_bias, lower)."""
    s, lower = _split_scalar_mul(n)
    if lower is None or not is_call(s, aten.sigmoid.default):
        return Fail(n, f"the decay is not lower * sigmoid(...) (found {describe(n)})")
    m = s.args[0]
    if not is_call(m, aten.mul.Tensor):
        return Fail(m, f"the gate's sigmoid input is not exp(A_log) * (f + dt_bias) (found {describe(m)})")
    a, b = strip(m.args[0]), strip(m.args[1])
    if not is_call(a, aten.exp.default):
        a, b = b, a
    if not (is_call(a, aten.exp.default) and is_weight_like(a.args[0])):
        return Fail(m, "the gate's scale is not exp of a parameter (A_log)")
    if not is_call(b, aten.add.Tensor):
        return Fail(b, f"the gate's pre-activation is not f + dt_bias (found {describe(b)})")
    f, bias = b.args[0], b.args[1]
    if is_weight_like(f) and not is_weight_like(bias):
        f, bias = bias, f
    if not is_weight_like(bias):
        return Fail(b, "the gate's bias (dt_bias) is not a parameter")
    f = strip_converts(f)
    if shape(f) is None or len(shape(f)) != 3:
        return Fail(b, f"the gate's input is not [M, H, K] (shape {shape(f)})")
    return f, strip(a.args[0], converts=True), strip(bias, converts=True), lower


def match_kda_prologue(node: Node) -> KdaPrologueSite | Fail:
    """The prologue of an auto-functionalized k3model::kda_decode node (its kwargs q, k, g, beta)."""
    kw = node.kwargs
    if not all(key in kw for key in ("q", "k", "v", "g", "beta")):
        return Fail(node, "kda_decode is not called with keyword arguments q, k, v, g, beta")
    q = match_l2norm(kw["q"], "q")
    if isinstance(q, Fail):
        return q
    k = match_l2norm(kw["k"], "k")
    if isinstance(k, Fail):
        return k
    if k.scale != 1.0:
        return Fail(kw["k"], f"k is scaled after its L2 norm (by {k.scale}); only q is")
    if q.eps != k.eps:
        return Fail(kw["k"], f"q and k are normalised with different eps ({q.eps}, {k.eps})")
    qd, kd = _dtype_of(kw["q"]), _dtype_of(kw["k"])
    if qd is None or qd != kd:
        return Fail(kw["q"], f"q and k reach the recurrence in different dtypes ({qd}, {kd})")
    g = match_gate(kw["g"])
    if isinstance(g, Fail):
        return g
    f, a_log, dt_bias, lower = g
    beta = strip(kw["beta"])
    if not is_call(beta, aten.sigmoid.default):
        return Fail(beta, f"beta is not sigmoid(logits) (found {describe(beta)})")
    b = strip_converts(beta.args[0])
    return KdaPrologueSite(q=q, k=k, qk_dtype=qd, f=f, a_log=a_log, dt_bias=dt_bias, lower=lower, beta=b)


@dataclass
class KdaConvSite:
    xq: Node          # the conv's inputs: the q, k, v projection slices [M, C/3] (before the concatenation)
    xk: Node
    xv: Node
    state: Node       # the conv state [M, C, KW - 1] (a graph input: the model's cache)
    w: Node           # the depthwise weights [C, KW]
    parts: tuple      # the getitem nodes of the conv output's split into q, k, v
    new_state: Node   # slice(window, -1, -(KW - 1)): the value written back into the state


def _silu_input(n: Any) -> Any:
    """x of silu(x), decomposed (x / (1 + exp(-x))) or not; None if n is neither."""
    if is_call(n, aten.silu.default):
        return n.args[0]
    if is_call(n, aten.div.Tensor) and is_call(n.args[1], aten.add.Tensor):
        x, add = n.args
        e = next((a for a in add.args if is_call(a, aten.exp.default)), None)
        one = next((a for a in add.args if scalar(a) == 1.0), None)
        if e is not None and one is not None and is_call(e.args[0], aten.neg.default) and e.args[0].args[0] is x:
            return x
    return None


def _strip_perm(n: Any) -> Any:
    """Through views, a permute / transpose of the last two dims, and views again."""
    n = strip(n)
    if is_call(n, aten.permute.default, aten.transpose.int):
        n = strip(n.args[0])
    return n


def match_kda_conv(core: Node) -> KdaConvSite | Fail:
    """The short conv (+ SiLU) whose output a KDA decode core's v (and q, k) are slices of, for one
    new token (layers.KDA.forward):
        window = cat([state, [xq | xk | xv] as [M, C, 1]], -1)
        new_state = window[..., -(KW - 1):]
        y = silu(sum(unfold(window, -1, KW, 1) * w[:, None, :], -1)) as [M, C]
        q, k, v = split(y, C / 3, -1)
    Walks back from the core's v (q and k may be normalised: fold_kda_gate or not)."""
    import operator
    v = core.kwargs.get("v")
    g = strip(v, converts=True)
    if not (is_call(g, operator.getitem) and is_call(g.args[0], aten.split.Tensor, aten.split_with_sizes.default)):
        return Fail(v if isinstance(v, Node) else core, "v is not a slice of a split (no conv output to fold)")
    split = g.args[0]
    parts = {u.args[1]: u for u in split.users if is_call(u, operator.getitem)}
    if sorted(parts) != [0, 1, 2] or g.args[1] != 2:
        return Fail(split, "the conv output is not split into exactly q, k, v (v third)")
    sil = strip(_strip_perm(split.args[0]), converts=True)
    x = _silu_input(sil)
    if x is None:
        return Fail(sil, f"the conv output is not SiLU(...) (found {describe(sil)})")
    sm = strip_converts(x)
    if not (is_call(sm, aten.sum.dim_IntList) and list(sm.args[1]) in ([-1], [3])):
        return Fail(sm, f"the conv is not a sum over the window (found {describe(sm)})")
    mul = sm.args[0]
    if not is_call(mul, aten.mul.Tensor):
        return Fail(mul, f"the conv is not window * weights (found {describe(mul)})")
    unf = next((a for a in mul.args if is_call(a, aten.unfold.default)), None)
    wn = next((a for a in mul.args if a is not unf), None)
    if unf is None or not is_weight_like(wn):
        return Fail(mul, "the conv is not unfold(window) * a weight")
    w = strip(wn)
    win = unf.args[0]
    kw = unf.args[2]
    if unf.args[1] not in (-1, 2) or unf.args[3] != 1 or shape(w) is None or len(shape(w)) != 2 or shape(w)[1] != kw:
        return Fail(unf, "the window is not unfolded along time with step 1 by the weights' width")
    if not (is_call(win, aten.cat.default) and len(win.args[0]) == 2 and (len(win.args) < 2 or win.args[1] in (-1, 2))):
        return Fail(win, f"the window is not cat([state, x], -1) (found {describe(win)})")
    state, xt = win.args[0]
    if not (isinstance(state, Node) and state.op == "placeholder"):
        return Fail(win, "the window's first part is not the conv state (a graph input)")
    if shape(xt) is None or len(shape(xt)) != 3 or shape(xt)[2] != 1:
        return Fail(win, "more than one new token (prefill): the decode conv takes one")
    cat = _strip_perm(xt)
    if not (is_call(cat, aten.cat.default) and len(cat.args[0]) == 3):
        return Fail(xt, f"the new token is not cat([xq, xk, xv]) (found {describe(cat)})")
    xq, xk, xv = cat.args[0]
    if not (len(shape(xq) or ()) == 2 and shape(xq) == shape(xk) == shape(xv)):
        return Fail(cat, "q, k and v inputs of the conv differ in shape")
    others = [u for u in win.users if u is not unf]
    if len(others) != 1 or not is_call(others[0], aten.slice.Tensor) or others[0].args[1] not in (-1, 2) \
            or others[0].args[2] not in (1, -(kw - 1)):
        return Fail(win, "the window is used other than by the conv and the state update")
    return KdaConvSite(xq=xq, xk=xk, xv=xv, state=state, w=w, parts=(parts[0], parts[1], parts[2]),
                       new_state=others[0])


__all__ = ["KdaConvSite", "KdaPrologueSite", "L2NormSite", "match_gate", "match_kda_conv", "match_kda_prologue",
           "match_l2norm"]
