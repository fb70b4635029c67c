"""Normalise spellings of the same math before the K3 patterns run (always on, semantics-preserving).

- `aten.copy(dst, src)` with equal shape and dtype -> `src` (what functionalisation leaves of an
  in-place `dist.all_reduce(x)` / `x.copy_(y)`).
- vLLM's `torch.ops.vllm.all_reduce(x, group_name)` -> `wait_tensor(_c10d_functional.all_reduce(x, "sum", group_name))`.
Returns how many nodes it rewrote.
"""
from __future__ import annotations

import torch
from torch.fx import Graph

from ..patterns.graph import aten, c10d, dtype, is_call, shape, val


def _vllm_all_reduce():
    try:
        return torch.ops.vllm.all_reduce.default
    except (AttributeError, RuntimeError):
        return None


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
    return changed
