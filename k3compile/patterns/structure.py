"""What K3 structure a graph holds: how many attention and MoE layers, TP size, M, dtype.

The expected site count of every pass is derived from this (an attention core per layer, an
expert op per MoE layer), so a site that fails to match shows up as "matched < expected".
Attention cores and expert ops are recognised by op name: our reference model's `k3model::*`
ops, plus names a user adds (K3_ATTENTION_OPS / K3_EXPERT_OPS, comma-separated `ns::name`).
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from .graph import c10d, dtype, is_call, shape

ATTENTION_OPS = {"k3model::kda_decode", "k3model::kda_prefill", "k3model::mla_decode", "k3model::mla_prefill",
                 "k3::kda_decode_gated", "k3::mla_decode_normed",   # after fold_kda_gate / fold_mla_prologue
                 "k3::kda_decode_fb", "k3::kda_step_decode_",       # after fold_kda_fb / fold_kda_step
                 "k3::mla_decode_uv"}                               # after fold_mla_output
EXPERT_OPS = {"k3model::mxfp4_experts", "k3::mxfp4_experts"}  # the second: after fold_moe_finalize lowered it


def op_name(n: Node) -> str | None:
    """`ns::name` of the op a node calls, looking through auto_functionalized wrappers."""
    if not is_call(n):
        return None
    t = n.target
    if t in (torch.ops.higher_order.auto_functionalized, getattr(torch.ops.higher_order, "auto_functionalized_v2", None)):
        t = n.args[0]
    name = getattr(t, "name", None)
    if callable(name):
        s = name()  # OpOverload.name() -> 'ns::op.overload'
        return s.split(".")[0]
    return None


def _extra(var: str) -> set[str]:
    return {s.strip() for s in os.environ.get(var, "").split(",") if s.strip()}


@dataclass
class GraphInfo:
    attention: list = field(default_factory=list)   # attention core nodes, in graph order
    experts: list = field(default_factory=list)     # routed-expert op nodes
    groups: dict = field(default_factory=dict)      # group name -> (rank, size)
    tp: int = 1
    rank: int = 0
    group: str | None = None
    m: int | str | None = None                      # tokens per step: an int, or "dynamic"
    dtype: torch.dtype | None = None
    device: str | None = None                        # device type of the graph's tensor inputs

    @property
    def m_static(self) -> int | None:
        return self.m if isinstance(self.m, int) else None

    def summary(self) -> dict:
        return {
            "attention_layers": len(self.attention), "moe_layers": len(self.experts),
            "tp": self.tp, "m": self.m,
            "dtype": str(self.dtype).replace("torch.", "") if self.dtype else None, "device": self.device,
        }


def resolve_group(name: str) -> tuple[int, int]:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    pg = _resolve_process_group(name)
    return dist.get_rank(pg), dist.get_world_size(pg)


def analyze(graph) -> GraphInfo:
    info = GraphInfo()
    attn_ops, exp_ops = ATTENTION_OPS | _extra("K3_ATTENTION_OPS"), EXPERT_OPS | _extra("K3_EXPERT_OPS")
    dtypes, ms = Counter(), Counter()
    for n in graph.nodes:
        name = op_name(n)
        if name in attn_ops:
            info.attention.append(n)
        elif name in exp_ops:
            info.experts.append(n)
        if is_call(n, c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default):
            g = n.args[-1]
            if isinstance(g, str) and g not in info.groups:
                try:
                    info.groups[g] = resolve_group(g)
                except Exception:  # group not resolvable here (e.g. a graph loaded from a file)
                    info.groups[g] = (0, 1)
        if info.device is None and n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor):
            info.device = n.meta["val"].device.type
        if is_call(n, torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            dt, s = dtype(n), shape(n)
            if dt is not None:
                dtypes[dt] += 1
            if s:
                ms[s[0] if isinstance(s[0], int) else "dynamic"] += 1
    if info.groups:
        # the TP group is the one the most collectives use
        info.group = next(iter(info.groups))
        info.rank, info.tp = info.groups[info.group]
    if dtypes:
        info.dtype = dtypes.most_common(1)[0][0]
    if ms:
        info.m = ms.most_common(1)[0][0]
    return info
