"""Normalise spellings of the same math before the K3 patterns run (always on, semantics-preserving).

- `aten.copy(dst, src)` with equal shape and dtype -> `src` (what functionalisation leaves of an
  in-place `dist.all_reduce(x)` / `x.copy_(y)`).
- vLLM's `torch.ops.vllm.all_reduce(x, group_name)` -> `wait_tensor(_c10d_functional.all_reduce(x, "sum", group_name))`.
- vLLM IR's `torch.ops.vllm_ir.rms_norm(x, weight, epsilon[, variance_size=None])` -> the ATen
  RMSNorm (fp32 math, cast back) that `patterns.graph.match_rms_norm` recognises.
Returns how many nodes it rewrote.
"""
from __future__ import annotations

import torch
from torch.fx import Graph

from ..patterns.graph import aten, c10d, dtype, is_call, prims, shape, val
from ..patterns.structure import op_name


def _vllm_all_reduce():
    try:
        return torch.ops.vllm.all_reduce.default
    except (AttributeError, RuntimeError):
        return None


def _call(graph: Graph, target, args: tuple, like: torch.Tensor, dt: torch.dtype | None = None):
    n = graph.call_function(target, args)
    n.meta["val"] = like if dt is None else like.to(dt)
    return n


def _decompose_rms_norm(graph: Graph, n) -> bool:
    x, w, eps = (list(n.args) + [None, None, None])[:3]
    eps = n.kwargs.get("epsilon", eps)
    if len(n.args) > 3 and n.args[3] is not None or n.kwargs.get("variance_size") is not None:
        return False  # variance over a sub-range: not the K3 RMSNorm
    xv = val(x)
    with graph.inserting_before(n):
        xf = _call(graph, prims.convert_element_type.default, (x, torch.float32), xv, torch.float32)
        fv = val(xf)
        sq = _call(graph, aten.pow.Tensor_Scalar, (xf, 2), fv)
        mean = _call(graph, aten.mean.dim, (sq, [-1], True), fv.mean(-1, keepdim=True))
        add = _call(graph, aten.add.Tensor, (mean, eps), val(mean))
        r = _call(graph, aten.rsqrt.default, (add,), val(mean))
        y = _call(graph, aten.mul.Tensor, (xf, r), fv)
        if w is not None:
            wf = _call(graph, prims.convert_element_type.default, (w, torch.float32), val(w), torch.float32)
            y = _call(graph, aten.mul.Tensor, (y, wf), fv)
        out = _call(graph, prims.convert_element_type.default, (y, xv.dtype), xv)
    n.replace_all_uses_with(out)
    graph.erase_node(n)
    return True


def canonicalize(graph: Graph) -> int:
    changed = 0
    vllm_ar = _vllm_all_reduce()
    for n in list(graph.nodes):
        if is_call(n, aten.copy.default) and len(n.args) >= 2:
            dst, src = n.args[:2]
            if shape(dst) is not None and shape(dst) == shape(src) and dtype(dst) == dtype(src):
                n.replace_all_uses_with(src)
                graph.erase_node(n)
                changed += 1
        elif vllm_ar is not None and is_call(n, vllm_ar):
            x, group = n.args[:2]
            with graph.inserting_before(n):
                ar = graph.call_function(c10d.all_reduce.default, (x, "sum", group))
                ar.meta["val"] = val(n)
                w = graph.call_function(c10d.wait_tensor.default, (ar,))
                w.meta["val"] = val(n)
            n.replace_all_uses_with(w)
            graph.erase_node(n)
            changed += 1
        elif op_name(n) == "vllm_ir::rms_norm" and _decompose_rms_norm(graph, n):
            changed += 1
    return changed
