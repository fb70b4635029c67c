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

from typing import Any

from torch.fx import Node

from .graph import CONVERT_OPS, VIEW_OPS, Fail, is_call
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
