"""The K3 decoder's modules, plain PyTorch, one rank of tensor parallelism (spec section 2).

Every module owns only this rank's shard of its weights. Weights are generated from
(config.seed, parameter name) over the *full* shape and then sliced, so any TP size sees the
same model. Token-wise work runs on [N, hidden] with N = M * T tokens (T = 1 for decode); the
attention cores are the `k3model::*` custom ops of `attention_ops`.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import attention_ops  # noqa: F401  (registers torch.ops.k3model.kda_* / mla_*)
from . import moe_ops  # noqa: F401  (registers torch.ops.k3model.mxfp4_experts)
from .config import K3Config
from .functional import attnres_mix, rms_norm, situ_mlp
from .mxfp4 import quantize
from .tp import TPInfo, all_reduce


class WeightFactory:
    """Deterministic full-size weights from (seed, name); `meta=True` makes shapes only."""

    def __init__(self, cfg: K3Config, tp: TPInfo, device=None, meta: bool = False):
        self.cfg, self.tp, self.meta = cfg, tp, meta
        self.device = torch.device("meta") if meta else (torch.device(device) if device else None)

    def full(self, name: str, shape, std: float | None = None, mean: float = 0.0) -> torch.Tensor:
        if self.meta:
            return torch.empty(shape, device="meta", dtype=torch.float32)
        g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        std = (1.0 / math.sqrt(shape[-1])) if std is None else std
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    def param(self, t: torch.Tensor, dtype=None) -> nn.Parameter:
        dtype = dtype or self.cfg.torch_dtype
        t = t.to(dtype) if self.meta else t.to(device=self.device, dtype=dtype)
        return nn.Parameter(t, requires_grad=False)

    def norm_weight(self, name: str, n: int) -> nn.Parameter:
        return self.param(self.full(name, (n,), std=0.1, mean=1.0))

    def linear(self, name: str, out: int, inp: int, split: str | None = None) -> nn.Parameter:
        """split: None (replicated), 'out' (column-parallel), 'in' (row-parallel)."""
        w = self.full(name, (out, inp))
        if split == "out":
            w = self.tp.shard(w, 0)
        elif split == "in":
            w = self.tp.shard(w, 1)
        return self.param(w)


class AttnRes(nn.Module):
    def __init__(self, wf: WeightFactory, name: str):
        super().__init__()
        h = wf.cfg.hidden
        self.eps = wf.cfg.rms_eps
        self.w_norm = wf.norm_weight(f"{name}.w_norm", h)
        self.w_qk = wf.param(wf.full(f"{name}.w_qk", (h,), std=1.0))
        self.g = wf.norm_weight(f"{name}.g", h)

    def forward(self, prefix, delta, blocks):
        return attnres_mix(prefix, delta, blocks, self.w_norm, self.w_qk, self.g, self.eps)


class KDA(nn.Module):
    """Kimi Delta Attention, one rank: heads are sharded, f_a is replicated."""

    def __init__(self, wf: WeightFactory, name: str):
        super().__init__()
        c, tp = wf.cfg, wf.tp
        H, K = c.kda_heads, c.kda_head_dim
        self.Hr, self.K, self.eps, self.tp = H // tp.size, K, c.rms_eps, tp
        self.lower = c.kda_gate_lower
        self.conv_w = c.kda_conv
        hk = H * K
        shard = lambda n, *s: tp.shard(wf.full(f"{name}.{n}", s), 0)  # noqa: E731
        q, k, v, g = (shard(n, hk, c.hidden) for n in ("q", "k", "v", "g"))
        beta = shard("beta", H, c.hidden)
        fa = wf.full(f"{name}.f_a", (c.kda_f_rank, c.hidden))
        self.in_proj = wf.param(torch.cat([q, k, v, g, beta, fa], 0))
        self.splits = [self.Hr * K] * 4 + [self.Hr, c.kda_f_rank]
        self.f_b = wf.linear(f"{name}.f_b", hk, c.kda_f_rank, split="out")
        # depthwise conv weights for the q, k, v channels (each sharded by heads)
        self.conv = wf.param(torch.cat([shard(f"conv_{n}", hk, c.kda_conv) for n in "qkv"], 0))
        self.A_log = wf.param(tp.shard(wf.full(f"{name}.A_log", (H,), std=0.5), 0), torch.float32)
        self.dt_bias = wf.param(tp.shard(wf.full(f"{name}.dt_bias", (hk,), std=0.5), 0), torch.float32)
        self.o_norm = wf.norm_weight(f"{name}.o_norm", K)
        self.o_proj = wf.linear(f"{name}.o_proj", c.hidden, hk, split="in")

    def forward(self, x, conv_state, state, M: int, T: int):
        Hr, K = self.Hr, self.K
        q, k, v, g, beta, fa = torch.split(F.linear(x, self.in_proj), self.splits, dim=-1)
        # width-4 causal depthwise conv + SiLU over time on q, k, v; state holds the last 3 inputs
        qkv = torch.cat([q, k, v], -1).view(M, T, -1).transpose(1, 2)  # [M, C, T]
        window = torch.cat([conv_state, qkv], dim=-1)  # [M, C, 3 + T]
        conv_state.copy_(window[..., -(self.conv_w - 1):])
        cols = window.unfold(-1, self.conv_w, 1)  # [M, C, T, 4]
        qkv = F.silu((cols * self.conv.unsqueeze(1)).sum(-1)).transpose(1, 2).reshape(M * T, -1)
        q, k, v = qkv.split(Hr * K, dim=-1)
        q = F.normalize(q.view(-1, Hr, K).float(), dim=-1) * (K ** -0.5)
        k = F.normalize(k.view(-1, Hr, K).float(), dim=-1)
        v = v.view(-1, Hr, K)
        f = F.linear(fa, self.f_b).view(-1, Hr, K).float()
        glog = self.lower * torch.sigmoid(torch.exp(self.A_log).view(1, Hr, 1) * (f + self.dt_bias.view(1, Hr, K)))
        b = torch.sigmoid(beta.float())
        if T == 1:
            o = torch.ops.k3model.kda_decode(q.to(v.dtype), k.to(v.dtype), v, glog, b, state)
        else:
            sh = lambda t: t.reshape(M, T, *t.shape[1:])  # noqa: E731
            o = torch.ops.k3model.kda_prefill(sh(q.to(v.dtype)), sh(k.to(v.dtype)), sh(v), sh(glog), sh(b), state)
            o = o.reshape(M * T, Hr, K)
        o = rms_norm(o, self.o_norm, self.eps) * torch.sigmoid(g.view(-1, Hr, K))
        return all_reduce(F.linear(o.reshape(-1, Hr * K), self.o_proj), self.tp)


class MLA(nn.Module):
    """Multi-head latent attention, absorbed decode over a latent KV cache (no RoPE: mla_use_nope)."""

    def __init__(self, wf: WeightFactory, name: str):
        super().__init__()
        c, tp = wf.cfg, wf.tp
        H = c.mla_heads
        self.Hr, self.tp, self.eps = H // tp.size, tp, c.rms_eps
        self.L, self.R, self.nope, self.V = c.kv_lora, c.qk_rope, c.qk_nope, c.v_head
        qa = wf.full(f"{name}.q_a", (c.q_lora, c.hidden))
        kva = wf.full(f"{name}.kv_a", (c.kv_lora + c.qk_rope, c.hidden))
        gate = tp.shard(wf.full(f"{name}.gate", (H * c.v_head, c.hidden)), 0)
        self.qkv_a = wf.param(torch.cat([qa, kva, gate], 0))
        self.splits = [c.q_lora, c.kv_lora + c.qk_rope, self.Hr * c.v_head]
        self.q_a_norm = wf.norm_weight(f"{name}.q_a_norm", c.q_lora)
        self.kv_a_norm = wf.norm_weight(f"{name}.kv_a_norm", c.kv_lora)
        self.q_b = wf.linear(f"{name}.q_b", H * (c.qk_nope + c.qk_rope), c.q_lora, split="out")
        self.w_uk = wf.param(tp.shard(wf.full(f"{name}.w_uk", (H, c.qk_nope, c.kv_lora)), 0))
        self.w_uv = wf.param(tp.shard(wf.full(f"{name}.w_uv", (H, c.v_head, c.kv_lora)), 0))
        self.o_proj = wf.linear(f"{name}.o_proj", c.hidden, H * c.v_head, split="in")
        self.scale = (c.qk_nope + c.qk_rope) ** -0.5

    def forward(self, x, kv_cache, seq_lens, M: int, T: int):
        Hr, L = self.Hr, self.L
        q_a, kv_a, gate = torch.split(F.linear(x, self.qkv_a), self.splits, dim=-1)
        q_a = rms_norm(q_a, self.q_a_norm, self.eps)
        kv_new = torch.cat([rms_norm(kv_a[:, :L], self.kv_a_norm, self.eps), kv_a[:, L:]], -1)
        q = F.linear(q_a, self.q_b).view(-1, Hr, self.nope + self.R)
        q_nope, q_rope = q.split([self.nope, self.R], dim=-1)
        q_lat = torch.einsum("nhd,hdl->nhl", q_nope, self.w_uk)
        if T == 1:
            o_lat = torch.ops.k3model.mla_decode(q_lat, q_rope.contiguous(), kv_new, kv_cache, seq_lens, self.scale)
        else:
            sh = lambda t: t.reshape(M, T, *t.shape[1:])  # noqa: E731
            o_lat = torch.ops.k3model.mla_prefill(sh(q_lat), sh(q_rope.contiguous()), sh(kv_new), kv_cache, seq_lens,
                                                  self.scale).reshape(M * T, Hr, L)
        o = torch.einsum("nhl,hvl->nhv", o_lat, self.w_uv) * torch.sigmoid(gate.view(-1, Hr, self.V))
        return all_reduce(F.linear(o.reshape(-1, Hr * self.V), self.o_proj), self.tp)


class DenseMLP(nn.Module):
    """SiTU MLP, column-parallel [gate | up], row-parallel down, all-reduced."""

    def __init__(self, wf: WeightFactory, name: str, inter: int):
        super().__init__()
        c, tp = wf.cfg, wf.tp
        self.tp, self.beta, self.lbeta = tp, c.situ_beta, c.situ_linear_beta
        gate = tp.shard(wf.full(f"{name}.gate", (inter, c.hidden)), 0)
        up = tp.shard(wf.full(f"{name}.up", (inter, c.hidden)), 0)
        self.gate_up = wf.param(torch.cat([gate, up], 0))
        self.down = wf.linear(f"{name}.down", c.hidden, inter, split="in")

    def partial(self, x):
        return situ_mlp(x, self.gate_up, self.down, self.beta, self.lbeta)

    def forward(self, x):
        return all_reduce(self.partial(x), self.tp)


class LatentMoE(nn.Module):
    """Router + latent down-projection (replicated), MXFP4 routed experts (intermediate split
    across ranks), finalize, latent all-reduce, latent RMSNorm, row-split up-projection, SiTU
    shared expert, final all-reduce."""

    def __init__(self, wf: WeightFactory, name: str):
        super().__init__()
        c, tp = wf.cfg, wf.tp
        E, I, Lt = c.num_experts, c.expert_inter, c.latent
        self.cfg, self.tp, self.top_k, self.eps = c, tp, c.top_k, c.rms_eps
        self.router = wf.linear(f"{name}.router", E, c.hidden)
        self.router_bias = wf.param(wf.full(f"{name}.router_bias", (E,), std=0.02), torch.float32)
        self.latent_down = wf.linear(f"{name}.latent_down", Lt, c.hidden)
        self.latent_norm = wf.norm_weight(f"{name}.latent_norm", Lt)
        self.latent_up = wf.linear(f"{name}.latent_up", c.hidden, Lt, split="out")
        # MXFP4 experts: quantise the full weights, then take this rank's intermediate slice.
        # Blocks run along K; w2's K is the intermediate, split in multiples of 32, so the
        # slice of the quantised full tensor equals quantising the slice.
        Ir = I // tp.size
        if wf.meta:
            mk = lambda *s: torch.empty(s, dtype=torch.uint8, device="meta")  # noqa: E731
            w13, s13 = mk(E, 2 * Ir, Lt // 2), mk(E, 2 * Ir, Lt // 32)
            w2, s2 = mk(E, Lt, Ir // 2), mk(E, Lt, Ir // 32)
        else:
            gate = tp.shard(wf.full(f"{name}.experts.gate", (E, I, Lt)), 1)
            up = tp.shard(wf.full(f"{name}.experts.up", (E, I, Lt)), 1)
            w13, s13 = quantize(torch.cat([gate, up], 1))
            down_p, down_s = quantize(wf.full(f"{name}.experts.down", (E, Lt, I)))
            w2, s2 = tp.shard(down_p, 2), tp.shard(down_s, 2)
            w13, s13, w2, s2 = (t.to(wf.device) if wf.device else t for t in (w13, s13, w2, s2))
        self.register_buffer("w13", w13)
        self.register_buffer("w13_scale", s13)
        self.register_buffer("w2", w2)
        self.register_buffer("w2_scale", s2)
        self.shared = DenseMLP(wf, f"{name}.shared", c.shared_inter)

    def route(self, x):
        scores = torch.sigmoid(F.linear(x, self.router).float())
        _, ids = torch.topk(scores + self.router_bias, self.top_k, dim=-1)
        w = scores.gather(-1, ids)
        w = w / w.sum(-1, keepdim=True) * self.cfg.routed_scaling
        return ids, w

    def forward(self, x):
        c, tp = self.cfg, self.tp
        ids, w = self.route(x)
        lat = F.linear(x, self.latent_down)
        y = torch.ops.k3model.mxfp4_experts(lat, ids, self.w13, self.w13_scale, self.w2, self.w2_scale,
                                            c.situ_beta, c.situ_linear_beta)
        routed_partial = (y.float() * w.unsqueeze(-1)).sum(1).to(x.dtype)  # finalize
        routed = all_reduce(routed_partial, tp)
        tail = F.linear(rms_norm(routed, self.latent_norm, self.eps), self.latent_up)
        final = self.shared.partial(x)
        if tp.size == 1:
            final = final + tail
        else:
            n = tail.shape[-1]
            final = final.clone()
            final[:, tp.rank * n:(tp.rank + 1) * n] += tail
        return all_reduce(final, tp)


class DecoderLayer(nn.Module):
    def __init__(self, wf: WeightFactory, idx: int):
        super().__init__()
        c = wf.cfg
        self.idx, self.is_mla, self.is_dense = idx, c.is_mla(idx), c.is_dense(idx)
        self.writes_block = c.writes_block(idx)
        self.max_blocks = c.attnres_max_blocks
        self.attn_res = AttnRes(wf, f"l{idx}.attn_res")
        self.attn = MLA(wf, f"l{idx}.mla") if self.is_mla else KDA(wf, f"l{idx}.kda")
        self.mlp_res = AttnRes(wf, f"l{idx}.mlp_res")
        self.mlp = DenseMLP(wf, f"l{idx}.dense", c.dense_inter) if self.is_dense else LatentMoE(wf, f"l{idx}.moe")

    def forward(self, prefix, delta, blocks: list, cache, M: int, T: int):
        x, prefix = self.attn_res(prefix, delta, blocks)
        if self.writes_block and len(blocks) < self.max_blocks:
            blocks.append(prefix)
        if self.is_mla:
            a = self.attn(x, cache.kv[self.idx], cache.seq_lens, M, T)
        else:
            a = self.attn(x, cache.conv[self.idx], cache.state[self.idx], M, T)
        x, prefix = self.mlp_res(prefix, a, blocks)
        return prefix, self.mlp(x)
