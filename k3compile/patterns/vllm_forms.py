"""Sites that vLLM's own fusion passes rewrote before the K3 passes run.

vLLM runs its post-grad fusions first and the K3 pass after them (`k3compile.integrations.vllm`).
With `PassConfig(fuse_allreduce_rms=True)` its AllReduceFusionPass (FlashInfer, CUDA) replaces
`all_reduce(x) -> fused_add_rms_norm(., residual)` / `-> rms_norm` by one mutating op, which reaches
us as `auto_functionalized(torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm, allreduce_in=x,
residual=..., norm_out=..., ...)`; on ROCm the AITER variant emits `torch.ops.vllm.rocm_aiter_fused_allreduce_rmsnorm*`.
Such a site is already fused: the K3 passes leave it as vLLM fused it and say so in the report
(`Prefused`, a `Fail` that `K3Pass.collect` turns into a note instead of a near-miss, and that
does not count towards the pass's expected sites).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from .graph import CONVERT_OPS, VIEW_OPS, Fail, aten, dtype, is_call, prims, shape, val
from .structure import op_name

VLLM_FUSED_ALLREDUCE_OPS = {
    "vllm::flashinfer_trtllm_fused_allreduce_norm": "FlashInfer all-reduce + (residual add +) RMSNorm",
    "vllm::rocm_aiter_fused_allreduce_rmsnorm": "AITER all-reduce + (residual add +) RMSNorm",
    "vllm::rocm_aiter_fused_allreduce_rmsnorm_quant_per_group": "AITER all-reduce + RMSNorm + quant",
    "vllm::rocm_aiter_fused_allreduce_rmsnorm_quant_per_group_with_bf16_norm": "AITER all-reduce + RMSNorm + quant",
}


class Prefused(Fail):
    """The site's all-reduce was already fused by vLLM: not a near-miss, left as it is."""


def is_vllm_fused_allreduce(n: Any) -> bool:
    return op_name(n) in VLLM_FUSED_ALLREDUCE_OPS


def prefused(x: Any) -> Prefused | None:
    """If `x` (through views and casts) goes into a vLLM-fused all-reduce op, say so."""
    stack, seen = [x], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, Node) or n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if is_vllm_fused_allreduce(u):
                name = op_name(u)
                return Prefused(u, f"already fused by vLLM ({name.split('::')[1]}: "
                                   f"{VLLM_FUSED_ALLREDUCE_OPS[name]}); left as vLLM fused it")
            if is_call(u) and (u.target in VIEW_OPS or u.target in CONVERT_OPS):
                stack.append(u)
    return None


def count_vllm_fused_allreduces(graph) -> int:
    return sum(1 for n in graph.nodes if is_vllm_fused_allreduce(n))


# ----------------------------------------------------------------- vLLM's AttnRes kernel, as ATen math
ATTN_RES_KERNELS = ("_attn_res_kernel",)   # vllm/models/kimi_k3/nvidia/ops/attn_res.py (Triton)


def _triton_kernel(n: Any):
    """(kernel, constant args) of a `triton_kernel_wrapper_functional` node, or None."""
    hop = getattr(torch.ops.higher_order, "triton_kernel_wrapper_functional", None)
    if hop is None or not is_call(n, hop):
        return None
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    try:
        kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
        consts = kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])
    except (KeyError, AssertionError, IndexError):
        return None
    return kernel, consts


def is_vllm_attn_res(n: Any) -> bool:
    k = _triton_kernel(n)
    fn = getattr(k[0], "fn", None) if k else None
    return (fn is not None and fn.__name__ in ATTN_RES_KERNELS
            and fn.__module__.startswith("vllm.models.kimi_k3"))


def has_vllm_attn_res(graph) -> bool:
    return any(is_vllm_attn_res(n) for n in graph.nodes if n.op == "call_function")


def decompose_vllm_attn_res(graph, n: Node) -> bool:
    """vLLM's AttnRes Triton kernel (`triton_kernel_wrapper_functional(_attn_res_kernel)`) -> the same math
    in ATen ops, the spelling the K3 patterns know: `updated = prefix + delta` in the model dtype (the
    kernel rounds the sum to it too), the block write as `select_scatter`, the mixer over
    [blocks[:num_blocks]..., updated] (fp32 RMS-normalised logits, softmax, weighted sum) and the output
    RMSNorm in fp32, cast to the output dtype. The kernel's in-place results map to the new values
    (prefix <- updated, blocks <- with the written block). Returns False (left as it is) for any
    launch it cannot read exactly."""
    k = _triton_kernel(n)
    if k is None or not is_vllm_attn_res(n):
        return False
    _, c = k
    t = dict(n.kwargs["kwargs"])
    t.update({key: v for key, v in c.items() if key.endswith("_ptr")})
    need = ("prefix_ptr", "blocks_ptr", "norm_weight_ptr", "qk_weight_ptr", "output_ptr")
    if any(not isinstance(t.get(key), Node) for key in need):
        return False
    try:
        nb, bw, eps = int(c["num_blocks"]), int(c["block_write_idx"]), float(c["eps"])
        oeps, has_delta = float(c["output_norm_eps"]), bool(c["HAS_DELTA"])
        write, apply_norm = bool(c["WRITE_BLOCK"]), bool(c["APPLY_OUTPUT_NORM"])
    except (KeyError, TypeError, ValueError):
        return False
    prefix, blocks, out_t = t["prefix_ptr"], t["blocks_ptr"], t["output_ptr"]
    delta, onw = t.get("delta_ptr"), t.get("output_norm_weight_ptr")
    if (has_delta and not isinstance(delta, Node)) or (apply_norm and not isinstance(onw, Node)):
        return False
    ps, bs = shape(prefix), shape(blocks)
    if ps is None or bs is None or len(ps) != 2 or len(bs) != 3 or (delta is not None and shape(delta) != ps):
        return False
    users = list(n.users)
    if any(not (is_call(u, operator.getitem) and isinstance(u.args[1], str)) for u in users):
        return False
    fake = torch._guards.detect_fake_mode([val(prefix)])
    f32 = torch.float32

    def op(target, *args):
        vals = torch.fx.node.map_arg(args, lambda a: val(a))
        with fake if fake is not None else _null():
            v = target(*vals)
        node = graph.call_function(target, args)
        node.meta["val"] = v
        return node

    def f(x):
        return op(prims.convert_element_type.default, x, f32)

    def rms(x, eps_):
        return op(aten.rsqrt.default, op(aten.add.Tensor, op(aten.mean.dim, op(aten.pow.Tensor_Scalar, x, 2), [-1], True), eps_))

    with graph.inserting_before(n):
        upd_lp = op(aten.add.Tensor, prefix, delta) if has_delta else prefix
        upd = f(upd_lp)
        new_blocks = blocks
        if write:
            new_blocks = op(aten.select_scatter.default, blocks,
                            op(prims.convert_element_type.default, upd_lp, dtype(blocks)), 1, bw)
        if nb == 0:
            mixed = upd
        else:
            past = f(op(aten.slice.Tensor, new_blocks, 1, 0, nb))
            values = op(aten.cat.default, [past, op(aten.unsqueeze.default, upd, 1)], 1)
            w = op(aten.mul.Tensor, f(t["norm_weight_ptr"]), f(t["qk_weight_ptr"]))
            logits = op(aten.mul.Tensor, op(aten.sum.dim_IntList, op(aten.mul.Tensor, values, w), [-1]),
                        op(aten.squeeze.dim, rms(values, eps), -1))
            # softmax, decomposed (a post-grad graph holds no aten._softmax for Inductor to lower)
            e = op(aten.exp.default, op(aten.sub.Tensor, logits, op(aten.amax.default, logits, [-1], True)))
            sm = op(aten.div.Tensor, e, op(aten.sum.dim_IntList, e, [-1], True))
            mixed = op(aten.sum.dim_IntList, op(aten.mul.Tensor, op(aten.unsqueeze.default, sm, -1), values), [1])
        out = mixed
        if apply_norm:
            out = op(aten.mul.Tensor, op(aten.mul.Tensor, mixed, rms(mixed, oeps)), f(onw))
        out_lp = op(prims.convert_element_type.default, out, dtype(out_t))
    new = {"prefix_ptr": upd_lp, "blocks_ptr": new_blocks, "output_ptr": out_lp}
    for u in users:
        u.replace_all_uses_with(new.get(u.args[1], t.get(u.args[1], u)))
        graph.erase_node(u)
    graph.erase_node(n)
    setattr(graph, "_k3_attn_res_prefix_resets", True)   # patterns.roles.RESET_MARK: its prefix restarts at block writes
    return True


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
