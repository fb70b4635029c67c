"""Normalise spellings of the same math before the K3 patterns run (always on, semantics-preserving).

- `aten.copy(dst, src)` with equal shape and dtype -> `src` (what functionalisation leaves of an
  in-place `dist.all_reduce(x)` / `x.copy_(y)`).
- vLLM's `torch.ops.vllm.all_reduce(x, group_name)` -> `wait_tensor(_c10d_functional.all_reduce(x, "sum", g))`,
  where `g` is the c10d name of the device group behind vLLM's group `group_name` (vLLM names its
  groups "tp:0", ...; the name is used as is when it is no vLLM group, e.g. already a c10d name).
- vLLM IR's `torch.ops.vllm_ir.rms_norm(x, weight, epsilon[, variance_size=None])` -> the ATen
  RMSNorm (fp32 math, cast back) that `patterns.graph.match_rms_norm` recognises.
- vLLM's fused add + RMSNorm, `(normed, residual_out) = fused_add_rms_norm(x, residual, weight, eps)`,
  in every form it reaches a post-grad graph: `vllm_ir.fused_add_rms_norm` (functional default
  overload, as vLLM's pre-grad pass leaves it), its `maybe_inplace` overload and the in-place
  `_C.fused_add_rms_norm(input!, residual!, weight, epsilon)` wrapped in `auto_functionalized` (v1, what
  vLLM configures) or `auto_functionalized_v2` (stock torch.compile) ->
  `residual_out = residual + x` (model dtype) and `normed = RMSNorm(residual_out) * weight`, the
  form the o-proj and AttnRes patterns match. (vLLM's CUDA kernel also normalises the sum rounded
  to the model dtype; its native IR implementation normalises the fp32 sum, a rounding-level
  difference within vLLM's own tolerance between providers.)
- `_C.rms_norm(result!, input, weight, epsilon)` in `auto_functionalized` -> the ATen RMSNorm.
- vLLM's Kimi K3 AttnRes Triton kernel (`triton_kernel_wrapper_functional(_attn_res_kernel)`), and its SM100
  op `_C::kimi_k3_attn_res` in auto_functionalized, -> its
  residual add, block write, mixer (the sources stacked along dim 0, each block the node written into
  its slot) and output RMSNorm as ATen ops in the spelling patterns/attnres.py parses (`patterns/vllm_forms.py`).
- Inductor's post-grad `addmm` pattern (torch/_inductor/fx_passes/post_grad.py: `mm(x, W) + c` ->
  `addmm(c, x, W)` on every device, on a GPU not where every user of the add is pointwise) ->
  `add(mm(x, W), c)` again, the form the model wrote and eager computes (the GEMM rounded, then the
  add). Only the addmm Inductor made: its node keeps the add's `original_aten` (aten.add.Tensor); an
  addmm the model wrote is left. The fold takes a layer's o-proj GEMM into its residual add where the
  residual also goes to a non-pointwise op (an AttnRes block write, an in-place prefix), hiding the
  residual stream's add (patterns/roles.py) at TP=1.
Forms it cannot rewrite exactly (a variance over a sub-range, mixed dtypes, a mutated argument that
is a view of another tensor, a donated input still read afterwards) are left as they are.
Returns how many nodes it rewrote.
"""
from __future__ import annotations

import operator
import sys

import torch
from torch.fx import Graph, Node

from ..patterns.graph import aten, c10d, dtype, is_call, prims, shape, val
from ..patterns.roles import RESET_MARK
from ..patterns.structure import op_name
from ..patterns.opcall import OpCall as _OpCall
from ..patterns.vllm_forms import attn_res_aten, decompose_vllm_attn_res, is_vllm_attn_res

_AF = torch.ops.higher_order.auto_functionalized
_AF2 = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)
# auto_functionalized_v2 kwargs that describe a mutated argument as a view of its base


def _vllm_all_reduce():
    try:
        return torch.ops.vllm.all_reduce.default
    except (AttributeError, RuntimeError):
        return None


def c10d_group_name(name: str) -> str:
    """The c10d group name behind vLLM's group `name` ("tp:0" -> its device group's name)."""
    ps = sys.modules.get("vllm.distributed.parallel_state")  # only if vLLM's groups exist in this process
    ref = getattr(ps, "_groups", {}).get(name) if ps is not None else None
    group = ref() if ref is not None else None
    pg = getattr(group, "device_group", None)
    return getattr(pg, "group_name", None) or name


def _call(graph: Graph, target, args: tuple, like: torch.Tensor, dt: torch.dtype | None = None):
    n = graph.call_function(target, args)
    n.meta["val"] = like if dt is None else like.to(dt)
    return n


def _rms_norm_nodes(graph: Graph, x: Node, w, eps: float) -> Node:
    """Insert (at the current insertion point) RMSNorm(x) * w in fp32, cast back to x's dtype."""
    xv = val(x)
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
    return _call(graph, prims.convert_element_type.default, (y, xv.dtype), xv)


def _decompose_rms_norm(graph: Graph, n) -> bool:
    x, w, eps = (list(n.args) + [None, None, None])[:3]
    eps = n.kwargs.get("epsilon", eps)
    w = n.kwargs.get("weight", w)
    if len(n.args) > 3 and n.args[3] is not None or n.kwargs.get("variance_size") is not None:
        return False  # variance over a sub-range: not the K3 RMSNorm
    with graph.inserting_before(n):
        out = _rms_norm_nodes(graph, x, w, eps)
    n.replace_all_uses_with(out)
    graph.erase_node(n)
    return True


# ----------------------------------------------------------------- calls of (possibly mutating) custom ops
def _other_readers(n: Node, handled: list[Node]) -> bool:
    """Does any output of `n` other than `handled` have users (a result this rewrite does not replace)?"""
    return any(u not in handled and u.users for u in n.users)


def _add_rms_norm(graph: Graph, c: _OpCall, x, res, w, eps, normed: list[Node], res_out: list[Node]) -> bool:
    """Replace `normed` readers by RMSNorm(res + x) * w and `res_out` readers by res + x."""
    if not (isinstance(x, Node) and isinstance(res, Node)) or dtype(x) != dtype(res) or shape(x) != shape(res):
        return False  # e.g. an fp32 residual stream: not the K3 form
    if not isinstance(eps, (int, float)) or _other_readers(c.node, normed + res_out):
        return False
    with graph.inserting_before(c.node):
        upd = _call(graph, aten.add.Tensor, (res, x), val(res))
        out = _rms_norm_nodes(graph, upd, w, float(eps)) if normed else None
    for g in normed:
        g.replace_all_uses_with(out)
    for g in res_out:
        g.replace_all_uses_with(upd)
    for g in list(c.node.users):
        graph.erase_node(g)
    graph.erase_node(c.node)
    return True


def _rewrite_norm_call(graph: Graph, n: Node) -> bool:
    name = op_name(n)
    if name not in ("vllm_ir::fused_add_rms_norm", "_C::fused_add_rms_norm", "_C::rms_norm"):
        return False
    c = _OpCall(n)
    if not c.ok:
        return False
    if name == "vllm_ir::fused_add_rms_norm":
        if c.arg("variance_size") is not None:
            return False
        if c.new("x") or c.new("x_residual"):  # maybe_inplace donates its inputs: contents undefined after
            return False
        return _add_rms_norm(graph, c, c.arg("x"), c.arg("x_residual"), c.arg("weight"), c.arg("epsilon"),
                             c.out(0), c.out(1))
    if n.target not in (_AF, _AF2):
        return False  # an in-place _C op outside auto_functionalized: not a functional graph
    if name == "_C::fused_add_rms_norm":  # input becomes the normed output, residual the new residual
        return _add_rms_norm(graph, c, c.arg("input"), c.arg("residual"), c.arg("weight"), c.arg("epsilon"),
                             c.new("input"), c.new("residual"))
    # _C::rms_norm(result!, input, weight, epsilon): result becomes RMSNorm(input)
    if not isinstance(c.arg("input"), Node) or not isinstance(c.arg("epsilon"), (int, float)):
        return False
    readers = c.new("result")
    if _other_readers(n, readers):
        return False
    with graph.inserting_before(n):
        out = _rms_norm_nodes(graph, c.arg("input"), c.arg("weight"), float(c.arg("epsilon")))
    for g in readers:
        g.replace_all_uses_with(out)
    for g in list(n.users):
        graph.erase_node(g)
    graph.erase_node(n)
    return True


def _rewrite_attn_res_op(graph: Graph, n: Node) -> bool:
    """vLLM's `_C::kimi_k3_attn_res(prefix!, delta?, blocks!, norm_weight, qk_weight, output_norm_weight?,
    output!, num_blocks, block_write_idx, eps, output_norm_eps)` (its SM100 AttnRes, in auto_functionalized)
    -> the same ATen math as the Triton kernel's (`vllm_forms.attn_res_aten`): the new prefix, blocks and
    output values take their readers."""
    if op_name(n) != "_C::kimi_k3_attn_res" or n.target not in (_AF, _AF2):
        return False
    c = _OpCall(n)
    if not c.ok:
        return False
    prefix, delta, blocks, out = c.arg("prefix"), c.arg("delta"), c.arg("blocks"), c.arg("output")
    nw, qw, onw = c.arg("norm_weight"), c.arg("qk_weight"), c.arg("output_norm_weight")
    nb, bw, eps, oeps = (c.arg(k) for k in ("num_blocks", "block_write_idx", "eps", "output_norm_eps"))
    if not all(isinstance(t, Node) for t in (prefix, blocks, out, nw, qw)) or not all(
            isinstance(v, (int, float)) for v in (nb, bw, eps, oeps)):
        return False
    readers = {name: c.new(name) for name in ("prefix", "blocks", "output")}
    if _other_readers(n, [g for gs in readers.values() for g in gs]):
        return False
    with graph.inserting_before(n):
        got = attn_res_aten(graph, prefix, delta, blocks, nw, qw, onw, int(nb), int(bw), float(eps), float(oeps),
                            dtype(out))
    if got is None:
        return False
    for name, v in zip(("prefix", "blocks", "output"), got):
        for g in readers[name]:
            g.replace_all_uses_with(v)
    for g in list(n.users):
        graph.erase_node(g)
    graph.erase_node(n)
    setattr(graph, RESET_MARK, True)   # its prefix restarts at block writes, as the Triton kernel's
    return True


# ----------------------------------------------------------------- Inductor's addmm fold
def is_inductor_addmm(n: Node) -> bool:
    """addmm(c, x, W) that Inductor's post-grad pattern made of `mm(x, W) + c` (the node keeps the
    add's original_aten), alpha = beta = 1."""
    # compared by name: the pattern matcher's copy of the meta holds an equal op, not the same object
    return (is_call(n, aten.addmm.default) and str(n.meta.get("original_aten")) == "aten.add.Tensor"
            and len(n.args) == 3 and n.kwargs.get("alpha", 1) == 1 and n.kwargs.get("beta", 1) == 1
            and isinstance(n.args[0], Node) and val(n) is not None)


def _unfold_addmm(graph: Graph, n: Node) -> None:
    c, x, w = n.args
    with graph.inserting_before(n):
        mm = graph.call_function(aten.mm.default, (x, w))
        add = graph.call_function(aten.add.Tensor, (mm, c))
    for new, op in ((mm, aten.mm.default), (add, aten.add.Tensor)):
        new.meta.update({k: v for k, v in n.meta.items() if k in ("stack_trace", "source_fn_stack", "nn_module_stack")})
        new.meta["val"], new.meta["original_aten"] = val(n), op
    n.replace_all_uses_with(add)
    graph.erase_node(n)


def canonicalize(graph: Graph) -> int:
    changed = 0
    vllm_ar = _vllm_all_reduce()
    for n in list(graph.nodes):
        if getattr(n, "_erased", False):  # a getitem of a call rewritten below
            continue
        if is_call(n, aten.copy.default) and len(n.args) >= 2:
            dst, src = n.args[:2]
            if shape(dst) is not None and shape(dst) == shape(src) and dtype(dst) == dtype(src):
                n.replace_all_uses_with(src)
                graph.erase_node(n)
                changed += 1
        elif vllm_ar is not None and is_call(n, vllm_ar):
            x = n.args[0] if n.args else n.kwargs["tensor"]
            group = n.args[1] if len(n.args) > 1 else n.kwargs["group_name"]
            with graph.inserting_before(n):
                ar = graph.call_function(c10d.all_reduce.default, (x, "sum", c10d_group_name(group)))
                ar.meta["val"] = val(n)
                w = graph.call_function(c10d.wait_tensor.default, (ar,))
                w.meta["val"] = val(n)
            n.replace_all_uses_with(w)
            graph.erase_node(n)
            changed += 1
        elif op_name(n) == "vllm_ir::rms_norm" and _decompose_rms_norm(graph, n):
            changed += 1
        elif _rewrite_norm_call(graph, n):
            changed += 1
        elif is_vllm_attn_res(n) and decompose_vllm_attn_res(graph, n):
            changed += 1
        elif _rewrite_attn_res_op(graph, n):
            changed += 1
        elif is_inductor_addmm(n):
            _unfold_addmm(graph, n)
            changed += 1
    return changed
