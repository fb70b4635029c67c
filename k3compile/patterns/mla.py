"""The MLA decode step's prologue, feeding `k3model::mla_decode` (K3-SPEC section 2, MLA):

    kv_new = cat([rms_norm(KVa[:, :L], w_kv, eps), KVa[:, L:]], -1)    KVa [M, L + R]: the kv_a columns of qkv_a
    q_rope = contiguous(Q[..., nope:])                                   optional: a copy of a strided view

`match_mla_prologue(node)` takes the auto-functionalized mla_decode node and returns KVa, w_kv, eps
and the q_rope to pass (the copy's source where q_rope is a contiguous copy of a view with unit
stride along R, else q_rope itself), or a Fail naming the node where the chain differs from this
form. Post-grad ATen forms: the column ranges are `slice(KVa, -1, a, b)` or `getitem(split(KVa))`;
the norm is `patterns.graph.match_rms_norm`'s (fp32 cast, pow, mean, add eps, rsqrt, mul, mul by
the weight, cast back).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from .graph import Fail, aten, describe, dtype, is_call, match_rms_norm, shape, val

_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}


@dataclass
class MlaPrologueSite:
    kv_a: Node       # [M, L + R], the un-normalised latent + rope key of the new token
    kv_norm_w: Node  # [L]
    eps: float
    q_rope: Node     # what the fused op takes (the copy's source where there was a copy)
    copy_dropped: bool
    rounding: int = 0  # the latent RMSNorm's rounding order (k3compile/rounding.py)


def _whole(n: Any) -> Any:
    """Below slices that keep every row (`x[:, ...]` in a dynamic-M graph: slice(x, 0, 0, INT_MAX))."""
    while (is_call(n, aten.slice.Tensor) and len(n.args) >= 2 and n.args[1] == 0
           and (n.args[2] if len(n.args) > 2 else 0) == 0 and (n.args[3] if len(n.args) > 3 else 1 << 62) >= 1 << 62
           and (n.args[4] if len(n.args) > 4 else 1) == 1):
        n = n.args[0]
    return n


def _columns(n: Any) -> tuple[Node, int, int] | None:
    """(source, start, end) when n is the last-dim column range [start, end) of a 2-D source."""
    if is_call(n, aten.slice.Tensor) and isinstance(n.args[0], Node):
        src = _whole(n.args[0])
        s = shape(src)
        dim = n.args[1] if len(n.args) > 1 else 0
        if s is None or len(s) != 2 or dim not in (-1, 1) or not isinstance(s[1], int):
            return None
        start = n.args[2] if len(n.args) > 2 else 0
        end = n.args[3] if len(n.args) > 3 else s[1]
        step = n.args[4] if len(n.args) > 4 else 1
        if not (isinstance(start, int) and isinstance(end, int)) or step != 1:
            return None
        return src, start, min(end, s[1])
    if is_call(n) and n.target is operator.getitem and is_call(n.args[0], *_SPLITS):
        sp, i = n.args
        src = sp.args[0]
        s = shape(src)
        dim = sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0)
        if s is None or len(s) != 2 or dim not in (-1, 1) or not isinstance(s[1], int):
            return None
        sizes = sp.args[1]
        if isinstance(sizes, int):
            sizes = [sizes] * -(-s[1] // sizes)
        if not all(isinstance(z, int) for z in sizes):
            return None
        start = sum(sizes[:i])
        return src, start, min(start + sizes[i], s[1])
    return None


def _contiguous_copy_source(n: Any) -> Node | None:
    """x where n = clone(x, memory_format=contiguous) (or x.contiguous()) and x has unit stride along
    its last dim (what the op's kernel reads); None otherwise."""
    if not is_call(n, aten.clone.default, aten.contiguous.default) or not isinstance(n.args[0], Node):
        return None
    fmt = n.kwargs.get("memory_format", torch.contiguous_format if n.target is aten.contiguous.default else None)
    if fmt is not torch.contiguous_format:
        return None
    v = val(n.args[0])
    return n.args[0] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.stride(-1) == 1 else None


def match_mla_prologue(node: Node) -> MlaPrologueSite | Fail:
    kw = node.kwargs
    if not all(k in kw for k in ("q_lat", "q_rope", "kv_new")):
        return Fail(node, "mla_decode's arguments are not keywords (not an auto_functionalized call)")
    L = (shape(kw["q_lat"]) or (None,))[-1]
    cat = kw["kv_new"]
    if not is_call(cat, aten.cat.default) or len(cat.args[0]) != 2 or (cat.args[1] if len(cat.args) > 1 else 0) not in (-1, 1):
        return Fail(cat, f"kv_new is not cat([normed latent, rope key], -1) (found {describe(cat)})")
    normed, rope = cat.args[0]
    site = match_rms_norm(normed)
    if isinstance(site, Fail):
        return Fail(site.node, f"kv_new's latent part is not an RMSNorm: {site.reason}")
    if site.weight is None or shape(site.weight) != (L,):
        return Fail(normed, f"kv_new's latent RMSNorm has no [{L}] weight")
    if dtype(normed) != dtype(site.x):
        return Fail(normed, f"the normed latent is {dtype(normed)}, not its input's {dtype(site.x)}")
    lat, rk = _columns(site.x), _columns(rope)
    if lat is None or rk is None:
        return Fail(cat, "kv_new's parts are not column ranges of one [M, L + R] tensor")
    (src, a, b), (src2, c, d) = lat, rk
    width = shape(src)[1]
    if src is not src2 or (a, b, c, d) != (0, L, L, width):
        return Fail(cat, f"kv_new is not [norm(kv_a[:, :{L}]), kv_a[:, {L}:]] of one kv_a")
    v = val(src)
    if not isinstance(v, torch.Tensor) or v.stride(-1) != 1:
        return Fail(src, "kv_a has no unit stride along its columns")
    q_rope = kw["q_rope"]
    base = _contiguous_copy_source(q_rope)
    return MlaPrologueSite(src, site.weight, site.eps, base if base is not None else q_rope, base is not None,
                          site.rounding)
