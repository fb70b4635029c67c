"""What K3 structure a graph holds: its decoder layers, TP size, M, dtype.

The layers are found by role (`patterns.roles`): the residual stream's adds, and what each add's
delta is (an attention o-proj, a dense MLP, a MoE with its router top-k, or a MoE in vLLM's opaque
op with its router logits and latent computed outside it), whatever the ops inside
the attention cores and experts are. The expected site count of every pass derives from these
(an o-proj per layer, a router per MoE layer), so a site that fails to match shows up as
"matched < expected". Known opaque ops are mapped to roles as well (`ATTENTION_OPS`, vLLM's Kimi K3
cores among them, `EXPERT_OPS`, plus names a user adds in K3_KNOBS attention_ops / K3_KNOBS
expert_ops, comma-separated `ns::name`): the folds that rewrite an attention core need its op; where a graph has no role-found
layers (a graph cut inside a layer), the layers counted from these ops stand in.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from .graph import c10d, dtype, is_call, shape
from .roles import VLLM_ATTENTION_OPS, Layer, ResidualAdd, layers as role_layers, op_name, residual_stream  # noqa: F401
from .roles import routers as role_routers

ATTENTION_OPS = {"k3model::kda_decode", "k3model::kda_prefill", "k3model::mla_decode", "k3model::mla_prefill",
                 "k3::kda_decode_gated", "k3::mla_decode_normed",   # after fold_kda_gate / fold_mla_prologue
                 "k3::kda_decode_fb", "k3::kda_step_decode_",       # after fold_kda_fb / fold_kda_step
                 "k3::mla_decode_uv",                               # after fold_mla_output
                 *VLLM_ATTENTION_OPS}                               # vLLM's own (roles.py); no fold rewrites them
EXPERT_OPS = {"k3model::mxfp4_experts", "k3::mxfp4_experts"}  # the second: after fold_moe_finalize lowered it


def _extra(var: str) -> set[str]:
    from ..config import knob
    return {s.strip() for s in knob(var).split(",") if s.strip()}


@dataclass
class GraphInfo:
    attention: list = field(default_factory=list)   # attention core nodes (known ops), in graph order
    experts: list = field(default_factory=list)     # routed-expert op nodes (known ops)
    layers: list = field(default_factory=list)      # roles.Layer per decoder layer, found by role
    stream: list = field(default_factory=list)      # roles.ResidualAdd: the residual stream, in order
    routers: list = field(default_factory=list)     # roles.ResidualAdd of kind "moe" per router top-k
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

    @property
    def oproj(self) -> list:
        """The o-proj GEMM of each decoder layer (role-found)."""
        return [lay.attention.gemm for lay in self.layers]

    @property
    def moe(self) -> list:
        """The MoE sub-layer (a roles.ResidualAdd, kind "moe", with its router top-k) of each MoE layer,
        with the routers outside the stream (add None) after them."""
        return self.routers

    @property
    def ffn(self) -> list:
        """The residual adds that are layer inputs: MLP / MoE outputs (each a layer input, or the final
        norm's) and a traced layer's input add."""
        return [r for r in self.stream if r.kind in ("mlp", "moe", "input")]

    @property
    def moe_in_op(self) -> list:
        """The MoE sub-layers whose router selection, experts and finalize are inside an opaque op of
        another project (roles.OPAQUE_MOE_OPS: vLLM's moe_forward_shared); their `op` is that node."""
        return [r for r in self.routers if r.op is not None]

    @property
    def by_role(self) -> bool:
        """The layers were found by role (else the known attention / expert ops stand in)."""
        return bool(self.layers or self.routers)

    @property
    def n_attention(self) -> int:
        return len(self.layers) or len(self.attention)

    @property
    def n_moe(self) -> int:
        return len(self.routers) if self.by_role else len(self.experts)

    def summary(self) -> dict:
        return {
            "attention_layers": self.n_attention, "moe_layers": self.n_moe,
            "residual_adds": len(self.stream), "routers": len(self.routers),
            "moe_ops": sorted({op_name(r.op) for r in self.moe_in_op}),
            "unclassified": next((f"{r.add.name}: {r.why}" for r in self.stream if r.kind == "unknown"), None),
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
    attn_ops, exp_ops = ATTENTION_OPS | _extra("attention_ops"), EXPERT_OPS | _extra("expert_ops")
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
    info.stream = residual_stream(graph)
    info.layers = role_layers(info.stream)
    info.routers = role_routers(graph, info.stream)
    if dtypes:
        info.dtype = dtypes.most_common(1)[0][0]
    if ms:
        info.m = ms.most_common(1)[0][0]
    return info
