"""Sites that vLLM's own fusion passes rewrote before the K3 passes run.

vLLM runs its post-grad fusions first and the K3 pass after them (`k3compile.integrations.vllm`).
With `PassConfig(fuse_allreduce_rms=True)` its AllReduceFusionPass (FlashInfer, CUDA) replaces
`all_reduce(x) -> fused_add_rms_norm(., residual)` / `-> rms_norm` by one mutating op, which reaches
us as `auto_functionalized(torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm, allreduce_in=x,
residual=..., norm_out=..., ...)`; on ROCm the AITER variant emits `torch.ops.vllm.rocm_aiter_fused_allreduce_rmsnorm*`.
Such a site is already fused: the K3 passes leave it as vLLM fused it and say so in the report
(`Prefused`, a `Fail` that `K3Pass.collect` turns into a note instead of a near-miss, and that
does not count towards the pass's expected sites). The one exception is the norm-only form with a
residual of zeros on a MoE's latent (`flashinfer_norm_only`): it is the latent tail's own all-reduce +
RMSNorm, which k3::moe_latent_tail computes together with the up-projection and the add.

Also vLLM's Kimi K3 forms: its AttnRes Triton kernel as ATen math (`attn_res_aten`, used by the
canonicalisation), and its opaque MoE op's arguments and outputs (`moe_op_args`, `moe_op_outputs`) with
what runs inside it (`inside_moe_op`: a `NoSite` for the passes whose site is there).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from .graph import CONVERT_OPS, VIEW_OPS, Fail, NoSite, RmsNormSite, aten, dtype, is_call, prims, shape, val
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


# flashinfer.comm.AllReduceFusionPattern.kARResidualRMSNorm: all-reduce + residual add + RMSNorm
_FI_AR_RESIDUAL_RMS_NORM = 1
_ZEROS = ("aten::zeros", "aten::zeros_like", "aten::new_zeros")
_FILLS = ("aten::full", "aten::full_like", "aten::new_full", "aten::fill")


def _zeros(n: Any) -> bool:
    """n is all zeros by construction: zeros / zeros_like / full(.., 0), through views and slices."""
    while is_call(n) and (n.target in VIEW_OPS or n.target in CONVERT_OPS or op_name(n) in (
            "aten::slice", "aten::view", "aten::as_strided", "aten::expand")):
        n = n.args[0]
    name = op_name(n)
    if name in _ZEROS:
        return True
    return name in _FILLS and len(n.args) > 1 and n.args[1] in (0, 0.0)


def flashinfer_norm_only(n: Any, x: Node):
    """Where `n` is vLLM's FlashInfer fused all-reduce (in auto_functionalized) of `x` with a norm output and a
    residual of zeros (`allreduce_in=x, residual=zeros, norm_out=buf, rms_gamma=g, rms_eps=eps`: what vLLM's
    AllReduceFusionPass makes of all-reduce + RMSNorm, and what its Kimi K3 latent-MoE runner calls for the
    latent on Hopper): the RMSNorm of all_reduce(x) it computes, as an RmsNormSite (out: the norm output's
    new value; x: `x`, before its all-reduce). With a norm output the op writes the sum into allreduce_in
    and leaves the residual as it was (vLLM's `call_trtllm_fused_allreduce_norm`). A Fail saying why where
    `n` is that op in another form; None where it is not that op."""
    if op_name(n) != "vllm::flashinfer_trtllm_fused_allreduce_norm":
        return None
    from .opcall import OpCall as _OpCall   # noqa: PLC0415
    c = _OpCall(n)
    views = [k for k in ("allreduce_in", "norm_out") if any(f"_{k}{v}" in n.kwargs for v in (
        "_size", "_stride", "_storage_offset", "_slice_dim", "_alias"))]
    norm_out = c.new("norm_out")
    if views or c.arg("allreduce_in") is not x or len(norm_out) != 1 or any(
            not (is_call(u, operator.getitem) and isinstance(u.args[1], int)) for u in n.users):
        return Fail(n, "not the norm-only form (allreduce_in the finalized output, one norm output read)")
    if c.arg("pattern_code") != _FI_AR_RESIDUAL_RMS_NORM or c.arg("weight_bias") not in (None, 0, 0.0) or any(
            c.arg(k) is not None for k in ("quant_out", "scale_out", "scale_factor")):
        return Fail(n, f"pattern {c.arg('pattern_code')} (quantised or another fusion), not all-reduce + RMSNorm")
    if not _zeros(c.arg("residual")):
        return Fail(n, "its residual is not a tensor of zeros made in the graph: all-reduce + residual + RMSNorm")
    if any(u.users for u in c.new("allreduce_in")):
        return Fail(n, "the all-reduced sum it writes back is read too")
    eps = c.arg("rms_eps")
    if not isinstance(c.arg("rms_gamma"), Node) or not isinstance(eps, (int, float)):
        return Fail(n, "its RMSNorm weight or eps is not a tensor and a constant")
    return RmsNormSite(norm_out[0], x, c.arg("rms_gamma"), float(eps), [norm_out[0]])


def flashinfer_release(n: Node) -> None:
    """After a rewrite took the norm-only FlashInfer op `n` (`flashinfer_norm_only`): the residual's new value
    (which that form leaves as it was) is read from the residual itself, so nothing keeps `n` alive."""
    from .opcall import OpCall as _OpCall   # noqa: PLC0415
    c = _OpCall(n)
    for g in c.new("residual"):
        g.replace_all_uses_with(c.arg("residual"))


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
    """The graph holds vLLM's AttnRes: its Triton kernel or its `_C::kimi_k3_attn_res` op."""
    return any(is_vllm_attn_res(n) or op_name(n) == "_C::kimi_k3_attn_res" for n in graph.nodes
               if n.op == "call_function")


def decompose_vllm_attn_res(graph, n: Node) -> bool:
    """vLLM's AttnRes Triton kernel (`triton_kernel_wrapper_functional(_attn_res_kernel)`) -> the same math
    in ATen ops (`attn_res_aten`). The kernel's in-place results map to the new values (prefix <- updated,
    blocks <- with the written block). Returns False (left as it is) for any launch it cannot read exactly."""
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
    delta, onw = t.get("delta_ptr"), t.get("output_norm_weight_ptr")
    if (has_delta and not isinstance(delta, Node)) or (apply_norm and not isinstance(onw, Node)):
        return False
    users = list(n.users)
    if any(not (is_call(u, operator.getitem) and isinstance(u.args[1], str)) for u in users):
        return False
    with graph.inserting_before(n):
        got = attn_res_aten(graph, t["prefix_ptr"], delta if has_delta else None, t["blocks_ptr"],
                            t["norm_weight_ptr"], t["qk_weight_ptr"], onw if apply_norm else None, nb,
                            bw if write else -1, eps, oeps, dtype(t["output_ptr"]))
    if got is None:
        return False
    upd, blocks, out = got
    new = {"prefix_ptr": upd, "blocks_ptr": blocks, "output_ptr": out}
    for u in users:
        u.replace_all_uses_with(new.get(u.args[1], t.get(u.args[1], u)))
        graph.erase_node(u)
    graph.erase_node(n)
    setattr(graph, "_k3_attn_res_prefix_resets", True)   # patterns.roles.RESET_MARK: its prefix restarts at block writes
    return True


def block_slot(blocks: Node, i: int) -> Node | None:
    """The [M, H] node last written into slot i of an AttnRes block buffer [M, NB, H], through the
    functional block writes (`select_scatter(buf, src, 1, i)`) that lead to `blocks`; None where the
    slot's value comes from elsewhere (a buffer passed in, a write this walk cannot read)."""
    n = blocks
    for _ in range(256):
        n = _strip_views(n)
        if not is_call(n, aten.select_scatter.default) or len(n.args) < 4 or n.args[2] != 1:
            return None
        if n.args[3] == i:
            src, bs = n.args[1], _sig(blocks)
            return src if dtype(src) == dtype(blocks) and bs is not None and _sig(src) == bs[:1] + bs[2:] else None
        n = n.args[0]
    return None


def _sig(n: Any) -> tuple | None:
    """A node's shape as strings (a symbolic batch by name): compared without guarding on SymInts."""
    s = shape(n)
    return None if s is None else tuple(str(d) for d in s)


def _strip_views(n: Any) -> Any:
    while is_call(n, aten.alias.default):
        n = n.args[0]
    return n


def attn_res_aten(graph, prefix: Node, delta: Node | None, blocks: Node, norm_weight: Node, qk_weight: Node,
                  output_norm_weight: Node | None, num_blocks: int, block_write_idx: int, eps: float,
                  output_norm_eps: float, out_dtype: torch.dtype):
    """vLLM's Kimi K3 AttnRes (`_attn_res_kernel`, `_C::kimi_k3_attn_res`) as ATen ops at the graph's
    insertion point, in the spelling the K3 patterns parse (patterns.attnres `_match_stacked`):
    `updated = prefix + delta` in the model dtype (the kernel rounds the sum to it too), the block write
    as `select_scatter`, the mixer over the sources stacked along dim 0, [blocks[:num_blocks]..., updated]
    (each block the [M, H] node written into its slot where the graph shows it, else a `select` of the
    buffer; `cat` of the unsqueezed sources): fp32 RMS-normalised logits times norm_weight * qk_weight, softmax over the sources, the
    weighted sum; then the output RMSNorm in fp32, cast to `out_dtype`. The kernel scales each source's
    logit by its reciprocal RMS after the dot product; here the source is normalised first (fp32
    rounding only). Returns (updated, the new block buffer, output), or None for shapes it cannot read."""
    ps, bs = shape(prefix), shape(blocks)
    if ps is None or bs is None or len(ps) != 2 or len(bs) != 3 or (delta is not None and _sig(delta) != _sig(prefix)):
        return None
    if not 0 <= num_blocks <= bs[1] or block_write_idx >= bs[1]:
        return None
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

    upd_lp = op(aten.add.Tensor, prefix, delta) if delta is not None else prefix
    new_blocks = blocks
    if block_write_idx >= 0:
        new_blocks = op(aten.select_scatter.default, blocks,
                        op(prims.convert_element_type.default, upd_lp, dtype(blocks)), 1, block_write_idx)
    if num_blocks == 0:
        mixed = f(upd_lp)
    else:
        srcs = []
        for i in range(num_blocks):
            b = block_slot(new_blocks, i)
            b = b if b is not None else op(aten.select.int, new_blocks, 1, i)
            srcs.append(b if dtype(b) == dtype(upd_lp) else op(prims.convert_element_type.default, b, dtype(upd_lp)))
        # [S, M, H] fp32 (cat of unsqueezed sources: a post-grad graph holds no aten.stack for Inductor)
        values = f(op(aten.cat.default, [op(aten.unsqueeze.default, x, 0) for x in (*srcs, upd_lp)], 0))
        w = op(aten.mul.Tensor, f(norm_weight), f(qk_weight))
        logits = op(aten.sum.dim_IntList, op(aten.mul.Tensor, op(aten.mul.Tensor, values, rms(values, eps)), w), [-1])
        # softmax over the sources, decomposed (a post-grad graph holds no aten._softmax for Inductor to lower)
        e = op(aten.exp.default, op(aten.sub.Tensor, logits, op(aten.amax.default, logits, [0], True)))
        sm = op(aten.div.Tensor, e, op(aten.sum.dim_IntList, e, [0], True))
        mixed = op(aten.sum.dim_IntList, op(aten.mul.Tensor, op(aten.unsqueeze.default, sm, -1), values), [0])
    out = mixed
    if output_norm_weight is not None:
        out = op(aten.mul.Tensor, op(aten.mul.Tensor, mixed, rms(mixed, output_norm_eps)), f(output_norm_weight))
    return upd_lp, new_blocks, op(prims.convert_element_type.default, out, out_dtype)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


# ----------------------------------------------------------------- vLLM's opaque MoE op
# what each opaque MoE op holds (patterns.roles.OPAQUE_MOE_OPS): the parts of a MoE layer that no K3 pass
# can reach inside it
MOE_OP_HOLDS = {
    "vllm::moe_forward_shared": "the router's grouped top-k, the routed experts, their finalize and the shared expert",
    "vllm::moe_forward": "the router's grouped top-k, the routed experts and their finalize",
}


def moe_op_args(n: Node) -> dict:
    """A vLLM MoE op's arguments by schema name (`hidden_states` (the routed input: the latent),
    `router_logits`, `shared_experts_input`, ...), through auto_functionalized (vllm::moe_forward
    mutates its input)."""
    from .opcall import OpCall as _OpCall   # noqa: PLC0415
    return dict(_OpCall(n).args)


def moe_op_outputs(n: Node) -> tuple[Node | None, Node | None]:
    """(shared partial, routed partial) of vllm::moe_forward_shared: its outputs 0 and 1 (the getitem
    nodes reading them), each None where nothing reads it."""
    outs = {u.args[1]: u for u in n.users if is_call(u, operator.getitem) and isinstance(u.args[1], int)}
    return outs.get(0), outs.get(1)


def inside_moe_op(r, part: str) -> NoSite | None:
    """For a MoE found by role whose top-k is inside vLLM's opaque op (`r.op`): `part` (what the pass
    rewrites) is inside it, so there is no site (None where the MoE has no such op)."""
    if getattr(r, "op", None) is None:
        return None
    name = op_name(r.op)
    return NoSite(r.op, f"{part}: inside {name} ({r.op.name}, which holds {MOE_OP_HOLDS.get(name, 'the MoE')}), "
                        "out of K3's reach")
