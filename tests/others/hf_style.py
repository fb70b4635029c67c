"""Kimi K3 decoder, transformers style (written from /work/shared/K3-SPEC.md only).

Spellings on purpose:
  * nn.Module classes (KimiK3AttnRes, KimiK3KDAAttention, KimiK3MLAAttention, KimiK3MLP,
    KimiK3TopkRouter, KimiK3LatentMoE, KimiK3DecoderLayer, KimiK3Model, KimiK3ForCausalLM),
    nn.Linear(bias=False) for every projection, nn.RMSNorm for every norm, nn.Embedding.
  * KDA: separate q/k/v/g/beta/f_a/f_b projections, the short conv as F.conv1d(groups=C) on a
    [M, C, W] window, F.normalize for the L2 norm, the recurrence as batched matmuls.
  * MLA: separate q_a / kv_a_with_mqa / g projections, W_UK and W_UV absorbed by viewing
    kv_b_proj.weight, attention as F.scaled_dot_product_attention over the latent cache (bool mask),
    the new latent written with an index_put_ (cache[arange, pos] = entry).
  * AttnRes mixer: torch.stack of [blocks..., updated], softmax over dim 0, weighted sum.
  * Router: x.float() then F.linear with the fp32 weight, sigmoid, topk on scores + correction bias
    (selection only), gather, w / (sum + eps), * routed_scaling_factor.
  * Routed experts: opaque custom op torch.ops.hfk3.mxfp4_experts returning the UNFINALIZED
    [M, top_k, latent] expert outputs (bf16); finalize in the graph as
    (out * topk_w.unsqueeze(-1)).sum(1).
  * Latent tail: functional-collective all_reduce, nn.RMSNorm(latent), F.linear with the W_up shard,
    `shared_partial[:, lo:hi] += tail`, functional-collective all_reduce.
  * Residual: prefix + delta inside the mixer.
  * Collectives: torch.distributed._functional_collectives.all_reduce(t, "sum", group).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from . import weights as K3W

KimiK3Config = K3W.K3TinyConfig


def tiny_config(**overrides) -> KimiK3Config:
    return K3W.tiny_config(**overrides)


# --------------------------------------------------------------------------------------------
# SiTU and the MXFP4 expert custom op
# --------------------------------------------------------------------------------------------

def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    gate = gate.float()
    up = up.float()
    gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    up = linear_beta * torch.tanh(up / linear_beta)
    return gate * up


def _mxfp4_to_float(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., N, K/2] uint8 (low nibble first), scales [..., N, K/32] uint8 -> [..., N, K] fp32."""
    table = torch.tensor(K3W.E2M1_VALUES, dtype=torch.float32, device=codes.device)
    low = (codes & 0x0F).long()
    high = (codes >> 4).long()
    values = table[torch.stack((low, high), dim=-1).flatten(-2)]
    blocks = scales.shape[-1]
    scale = torch.pow(2.0, scales.float() - 127.0)
    return (values.unflatten(-1, (blocks, -1)) * scale.unsqueeze(-1)).flatten(-2)


def _mxfp4_experts_impl(hidden: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                        w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                        beta: float, linear_beta: float) -> torch.Tensor:
    """Routed MXFP4 experts, unfinalized.

    hidden [M, K] (the latent), topk_ids [M, top_k] int64, w13 [E, 2*I, K/2] ([gate; up] rows),
    w2 [E, N, I/2]; returns out[m, j] = W2[e] SiTU(W13[e] hidden[m]) for e = topk_ids[m, j],
    shape [M, top_k, N] in hidden.dtype (router weights NOT applied).
    """
    x = hidden.float()
    w13_f = _mxfp4_to_float(w13[topk_ids], w13_scale[topk_ids])      # [M, k, 2I, K]
    gate_up = torch.einsum("mc,mjnc->mjn", x, w13_f)
    gate, up = gate_up.chunk(2, dim=-1)
    mid = situ(gate, up, beta, linear_beta).to(hidden.dtype).float()
    w2_f = _mxfp4_to_float(w2[topk_ids], w2_scale[topk_ids])          # [M, k, N, I]
    return torch.einsum("mji,mjni->mjn", mid, w2_f).to(hidden.dtype)


def _mxfp4_experts_fake(hidden, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta):
    return hidden.new_empty(hidden.shape[0], topk_ids.shape[1], w2.shape[1])


def _register_mxfp4_experts():
    try:        # this file imported twice under two module names: keep the first registration
        return getattr(torch.ops.hfk3, "mxfp4_experts")
    except (AttributeError, RuntimeError):
        op = torch.library.custom_op("hfk3::mxfp4_experts", _mxfp4_experts_impl, mutates_args=())
        op.register_fake(_mxfp4_experts_fake)
        return op


mxfp4_experts = _register_mxfp4_experts()


# --------------------------------------------------------------------------------------------
# tensor parallel helpers
# --------------------------------------------------------------------------------------------

class TensorParallel:
    def __init__(self, rank: int = 0, world: int = 1, group=None):
        self.rank, self.world = rank, world
        self.group = group if group is not None or world == 1 else dist.group.WORLD

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        return funcol.all_reduce(t, "sum", self.group)


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------

class KimiK3AttnRes(nn.Module):
    """Attention residual mixer: (output, updated) = mixer(prefix, delta, blocks)."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.key_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)      # w_norm
        self.query = nn.Parameter(torch.zeros(config.hidden_size))                   # w_qk
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)          # g_out

    def forward(self, prefix, delta, blocks):
        updated = prefix if delta is None else prefix + delta
        if len(blocks) == 0:
            mixed = updated
        else:
            sources = torch.stack([*blocks, updated], dim=0)                       # [n, M, H]
            logits = (self.key_norm(sources).float() * self.query.float()).sum(-1)  # [n, M]
            probs = torch.softmax(logits, dim=0)
            mixed = (probs.unsqueeze(-1) * sources.float()).sum(0).to(updated.dtype)
        return self.norm(mixed), updated


class KimiK3KDAAttention(nn.Module):
    def __init__(self, config: KimiK3Config, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        self.num_heads = config.kda_num_heads // tp.world
        self.head_dim = config.kda_head_dim
        self.lower_bound = config.kda_gate_lower_bound
        self.l2_eps = config.l2norm_eps
        h, c, r, w = config.hidden_size, self.num_heads * self.head_dim, config.kda_gate_rank, config.kda_conv_size
        self.q_proj = nn.Linear(h, c, bias=False)
        self.k_proj = nn.Linear(h, c, bias=False)
        self.v_proj = nn.Linear(h, c, bias=False)
        self.g_proj = nn.Linear(h, c, bias=False)
        self.b_proj = nn.Linear(h, self.num_heads, bias=False)
        self.f_a_proj = nn.Linear(h, r, bias=False)        # replicated on every rank
        self.f_b_proj = nn.Linear(r, c, bias=False)
        self.q_conv1d = nn.Conv1d(c, c, w, groups=c, bias=False)
        self.k_conv1d = nn.Conv1d(c, c, w, groups=c, bias=False)
        self.v_conv1d = nn.Conv1d(c, c, w, groups=c, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(c))
        self.o_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(c, h, bias=False)

    @staticmethod
    def _short_conv(conv: nn.Conv1d, x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)       # [M, C, W]
        conv_state.copy_(window[:, :, 1:])
        return F.silu(F.conv1d(window, conv.weight, groups=conv.groups).squeeze(-1))

    def forward(self, hidden_states: torch.Tensor, cache: "KimiK3DecodeCache") -> torch.Tensor:
        bsz = hidden_states.shape[0]
        nh, d = self.num_heads, self.head_dim
        conv_q, conv_k, conv_v = cache.conv_states[self.layer_idx]
        q = self._short_conv(self.q_conv1d, self.q_proj(hidden_states), conv_q)
        k = self._short_conv(self.k_conv1d, self.k_proj(hidden_states), conv_k)
        v = self._short_conv(self.v_conv1d, self.v_proj(hidden_states), conv_v)
        q = F.normalize(q.view(bsz, nh, d).float(), p=2.0, dim=-1, eps=self.l2_eps) * d ** -0.5
        k = F.normalize(k.view(bsz, nh, d).float(), p=2.0, dim=-1, eps=self.l2_eps)
        v = v.view(bsz, nh, d).float()

        gate = self.f_b_proj(self.f_a_proj(hidden_states)).float().view(bsz, nh, d)
        gate = self.lower_bound * torch.sigmoid(self.A_log.float().exp().unsqueeze(-1)
                                                * (gate + self.dt_bias.float().view(nh, d)))
        decay = gate.exp()                                                # [M, nh, d_k]
        beta = torch.sigmoid(self.b_proj(hidden_states).float())         # [M, nh]

        state = cache.recurrent_states[self.layer_idx]                    # [M, nh, d_v, d_k] fp32
        s = state * decay.unsqueeze(-2)
        kv_mem = (s @ k.unsqueeze(-1)).squeeze(-1)                        # S k
        s = s + (beta.unsqueeze(-1) * (v - kv_mem)).unsqueeze(-1) * k.unsqueeze(-2)
        o = (s @ q.unsqueeze(-1)).squeeze(-1)                             # S q
        state.copy_(s)

        o = self.o_norm(o.to(hidden_states.dtype))
        o = o * torch.sigmoid(self.g_proj(hidden_states).view(bsz, nh, d))
        return self.tp.all_reduce(self.o_proj(o.reshape(bsz, nh * d)))


class KimiK3MLAAttention(nn.Module):
    def __init__(self, config: KimiK3Config, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        self.num_heads = config.mla_num_heads // tp.world
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.softmax_scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
        h, nh = config.hidden_size, self.num_heads
        self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, nh * (self.qk_nope_head_dim + self.qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, nh * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.g_proj = nn.Linear(h, nh * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(nh * self.v_head_dim, h, bias=False)

    def forward(self, hidden_states: torch.Tensor, cache: "KimiK3DecodeCache") -> torch.Tensor:
        bsz = hidden_states.shape[0]
        nh = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, nh, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        kv_c, k_pe = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)                       # no rotary on k_pe / q_pe (mla_use_nope)

        kv_cache = cache.kv_caches[self.layer_idx]             # [M, T, kv_lora + rope]
        positions = cache.positions
        kv_cache[torch.arange(bsz, device=positions.device), positions] = torch.cat([kv_c, k_pe], dim=-1)

        kv_b = self.kv_b_proj.weight.view(nh, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = kv_b[:, : self.qk_nope_head_dim], kv_b[:, self.qk_nope_head_dim:]
        q_latent = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)

        seq = kv_cache.shape[1]
        query = torch.cat([q_latent, q_pe], dim=-1).unsqueeze(2)                      # [M, nh, 1, C+R]
        key = kv_cache.unsqueeze(1).expand(bsz, nh, seq, kv_cache.shape[-1])
        value = kv_cache[..., : self.kv_lora_rank].unsqueeze(1).expand(bsz, nh, seq, self.kv_lora_rank)
        mask = (torch.arange(seq, device=positions.device).unsqueeze(0) <= positions.unsqueeze(1))
        attn = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None, None, :],
                                              scale=self.softmax_scale)                 # [M, nh, 1, C]
        attn = torch.einsum("bhc,hvc->bhv", attn.squeeze(2), w_uv)
        attn = attn * torch.sigmoid(self.g_proj(hidden_states).view(bsz, nh, self.v_head_dim))
        return self.tp.all_reduce(self.o_proj(attn.reshape(bsz, nh * self.v_head_dim)))


class KimiK3MLP(nn.Module):
    """SiTU MLP, column-parallel gate/up, row-parallel down; returns the TP-partial output."""

    def __init__(self, config: KimiK3Config, intermediate_size: int, tp: TensorParallel):
        super().__init__()
        i = intermediate_size // tp.world
        self.beta, self.linear_beta = config.situ_beta, config.situ_linear_beta
        self.gate_proj = nn.Linear(config.hidden_size, i, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, i, bias=False)
        self.down_proj = nn.Linear(i, config.hidden_size, bias=False)

    def forward(self, x):
        h = situ(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta).to(x.dtype)
        return self.down_proj(h)


class KimiK3TopkRouter(nn.Module):
    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.routed_scaling_factor = config.routed_scaling_factor
        self.eps = config.router_renorm_eps
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, hidden_states):
        router_logits = F.linear(hidden_states.float(), self.weight.float())
        scores = router_logits.sigmoid()
        scores_for_choice = scores + self.e_score_correction_bias.unsqueeze(0)
        topk_ids = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=True)[1]
        topk_weights = scores.gather(1, topk_ids)
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + self.eps)
        return topk_ids, topk_weights * self.routed_scaling_factor


class KimiK3LatentMoE(nn.Module):
    def __init__(self, config: KimiK3Config, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.beta, self.linear_beta = config.situ_beta, config.situ_linear_beta
        e, l, i = config.n_routed_experts, config.moe_latent_size, config.moe_intermediate_size // tp.world
        h, blk = config.hidden_size, config.mxfp4_block
        self.hidden_per_rank = h // tp.world
        self.gate = KimiK3TopkRouter(config)                                   # replicated
        self.latent_down_weight = nn.Parameter(torch.zeros(l, h))               # replicated
        self.register_buffer("w13_weight", torch.zeros(e, 2 * i, l // 2, dtype=torch.uint8))
        self.register_buffer("w13_scale", torch.zeros(e, 2 * i, l // blk, dtype=torch.uint8))
        self.register_buffer("w2_weight", torch.zeros(e, l, i // 2, dtype=torch.uint8))
        self.register_buffer("w2_scale", torch.zeros(e, l, i // blk, dtype=torch.uint8))
        self.latent_norm = nn.RMSNorm(l, eps=config.rms_norm_eps)
        self.latent_up_weight = nn.Parameter(torch.zeros(self.hidden_per_rank, l))   # rows of W_up
        self.shared_experts = KimiK3MLP(config, config.shared_intermediate_size, tp)

    def forward(self, hidden_states):
        topk_ids, topk_weights = self.gate(hidden_states)
        latent = F.linear(hidden_states, self.latent_down_weight)
        expert_out = torch.ops.hfk3.mxfp4_experts(latent, topk_ids, self.w13_weight, self.w13_scale,
                                                  self.w2_weight, self.w2_scale, self.beta, self.linear_beta)
        routed = (expert_out * topk_weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)
        routed = self.tp.all_reduce(routed)
        tail = F.linear(self.latent_norm(routed), self.latent_up_weight)
        out = self.shared_experts(hidden_states)
        lo = self.tp.rank * self.hidden_per_rank
        out[:, lo: lo + self.hidden_per_rank] += tail
        return self.tp.all_reduce(out)


class KimiK3DenseMLP(KimiK3MLP):
    def __init__(self, config: KimiK3Config, tp: TensorParallel):
        super().__init__(config, config.dense_intermediate_size, tp)
        self.tp = tp

    def forward(self, x):
        return self.tp.all_reduce(super().forward(x))


class KimiK3DecoderLayer(nn.Module):
    def __init__(self, config: KimiK3Config, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.layer_idx = layer_idx
        self.writes_block = config.writes_block(layer_idx)
        self.input_attn_res = KimiK3AttnRes(config)
        if config.layer_types[layer_idx] == "kda":
            self.self_attn = KimiK3KDAAttention(config, layer_idx, tp)
        else:
            self.self_attn = KimiK3MLAAttention(config, layer_idx, tp)
        self.post_attention_attn_res = KimiK3AttnRes(config)
        self.mlp = KimiK3DenseMLP(config, tp) if config.is_dense(layer_idx) else KimiK3LatentMoE(config, tp)

    def forward(self, prefix, mlp_delta, blocks: list, cache: "KimiK3DecodeCache"):
        hidden_states, prefix = self.input_attn_res(prefix, mlp_delta, blocks)
        if self.writes_block:
            slot = cache.attn_res_blocks[len(blocks)]
            slot.copy_(prefix)
            blocks.append(slot)
        attn_out = self.self_attn(hidden_states, cache)
        hidden_states, prefix = self.post_attention_attn_res(prefix, attn_out, blocks)
        return prefix, self.mlp(hidden_states)


class KimiK3DecodeCache:
    def __init__(self, config: KimiK3Config, conv_states, recurrent_states, kv_caches, positions,
                 attn_res_blocks):
        self.config = config
        self.conv_states = conv_states                # per layer (q, k, v) [M, C, W-1] or None
        self.recurrent_states = recurrent_states      # per layer [M, nh, d_v, d_k] fp32 or None
        self.kv_caches = kv_caches                    # per layer [M, T, kv_lora + rope] or None
        self.positions = positions                    # [M] int64
        self.attn_res_blocks = attn_res_blocks        # [n_blocks, M, H] block storage


class KimiK3Model(nn.Module):
    def __init__(self, config: KimiK3Config, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiK3DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.final_attn_res = KimiK3AttnRes(config)

    def forward(self, input_ids, cache):
        prefix = self.embed_tokens(input_ids)
        delta = None
        blocks: list = []
        for layer in self.layers:
            prefix, delta = layer(prefix, delta, blocks, cache)
        hidden_states, _ = self.final_attn_res(prefix, delta, blocks)
        return hidden_states


class KimiK3ForCausalLM(nn.Module):
    def __init__(self, config: KimiK3Config, tp: TensorParallel):
        super().__init__()
        self.config, self.tp = config, tp
        self.model = KimiK3Model(config, tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def step(self, input_ids: torch.Tensor, cache: KimiK3DecodeCache) -> torch.Tensor:
        """One decode token per sequence; updates `cache` in place; returns fp32 logits [M, V]."""
        logits = self.lm_head(self.model(input_ids, cache)).float()
        cache.positions.add_(1)
        return logits

    forward = step

    def new_cache(self, batch: int) -> KimiK3DecodeCache:
        cfg, tp = self.config, self.tp
        dtype = self.lm_head.weight.dtype
        full = K3W.full_cache(cfg, batch, dtype)
        conv, rec, kv = [], [], []
        for i, kind in enumerate(cfg.layer_types):
            p = f"layers.{i}"
            if kind == "kda":
                conv.append(tuple(full[f"{p}.conv_{n}"].chunk(tp.world, 1)[tp.rank].contiguous() for n in "qkv"))
                rec.append(full[f"{p}.state"].chunk(tp.world, 1)[tp.rank].contiguous())
                kv.append(None)
            else:
                conv.append(None)
                rec.append(None)
                kv.append(full[f"{p}.kv"].clone())
        blocks = torch.zeros(max(cfg.n_blocks(), 1), batch, cfg.hidden_size, dtype=dtype)
        return KimiK3DecodeCache(cfg, conv, rec, kv, full["pos"].clone(), blocks)


# --------------------------------------------------------------------------------------------
# weight loading (full weights -> this rank's shard)
# --------------------------------------------------------------------------------------------

def _load(model: KimiK3ForCausalLM, full: dict) -> None:
    cfg, tp = model.config, model.tp
    r, t = tp.rank, tp.world

    def rows(x):
        return x.chunk(t, 0)[r]

    def cols(x):
        return x.chunk(t, 1)[r]

    def put(param, value):
        assert param.shape == value.shape, (param.shape, value.shape)
        param.data = value.contiguous()

    def mixer(mod: KimiK3AttnRes, p):
        put(mod.key_norm.weight, full[f"{p}.w_norm"])
        put(mod.query, full[f"{p}.w_qk"])
        put(mod.norm.weight, full[f"{p}.g"])

    def mlp(mod: KimiK3MLP, p, inter):
        put(mod.gate_proj.weight, rows(full[f"{p}.gate_up"][:inter]))
        put(mod.up_proj.weight, rows(full[f"{p}.gate_up"][inter:]))
        put(mod.down_proj.weight, cols(full[f"{p}.down"]))

    put(model.model.embed_tokens.weight, full["embed"])
    put(model.lm_head.weight, full["lm_head"])
    mixer(model.model.final_attn_res, "final")
    for i, layer in enumerate(model.model.layers):
        p = f"layers.{i}"
        mixer(layer.input_attn_res, f"{p}.pre")
        mixer(layer.post_attention_attn_res, f"{p}.post")
        a = layer.self_attn
        if isinstance(a, KimiK3KDAAttention):
            for n in "qkvg":
                put(getattr(a, f"{n}_proj").weight, rows(full[f"{p}.{n}"]))
            put(a.b_proj.weight, rows(full[f"{p}.beta"]))
            put(a.f_a_proj.weight, full[f"{p}.f_a"])
            put(a.f_b_proj.weight, rows(full[f"{p}.f_b"]))
            for n in "qkv":
                put(getattr(a, f"{n}_conv1d").weight, rows(full[f"{p}.conv_{n}"]).unsqueeze(1))
            put(a.A_log, rows(full[f"{p}.A_log"]))
            put(a.dt_bias, rows(full[f"{p}.dt_bias"]))
            put(a.o_norm.weight, full[f"{p}.o_norm"])
            put(a.o_proj.weight, cols(full[f"{p}.o_proj"]))
        else:
            put(a.q_a_proj.weight, full[f"{p}.q_a"])
            put(a.kv_a_proj_with_mqa.weight, full[f"{p}.kv_a"])
            put(a.g_proj.weight, rows(full[f"{p}.gate"]))
            put(a.q_a_layernorm.weight, full[f"{p}.q_a_norm"])
            put(a.kv_a_layernorm.weight, full[f"{p}.kv_a_norm"])
            put(a.q_b_proj.weight, rows(full[f"{p}.q_b"]))
            put(a.kv_b_proj.weight, rows(full[f"{p}.kv_b"]))
            put(a.o_proj.weight, cols(full[f"{p}.o_proj"]))
        if isinstance(layer.mlp, KimiK3LatentMoE):
            m = layer.mlp
            inter = cfg.moe_intermediate_size
            put(m.gate.weight, full[f"{p}.router"])
            put(m.gate.e_score_correction_bias, full[f"{p}.router_bias"])
            put(m.latent_down_weight, full[f"{p}.lat_down"])
            put(m.latent_norm.weight, full[f"{p}.lat_norm"])
            put(m.latent_up_weight, rows(full[f"{p}.lat_up"]))
            for name, scale in (("w13", "w13_scale"),):
                for src, dst in ((name, m.w13_weight), (scale, m.w13_scale)):
                    w = full[f"{p}.{src}"]
                    put(dst, torch.cat([w[:, :inter].chunk(t, 1)[r], w[:, inter:].chunk(t, 1)[r]], dim=1))
            put(m.w2_weight, full[f"{p}.w2"].chunk(t, 2)[r])
            put(m.w2_scale, full[f"{p}.w2_scale"].chunk(t, 2)[r])
            mlp(m.shared_experts, f"{p}.shared", cfg.shared_intermediate_size)
        else:
            mlp(layer.mlp, f"{p}.mlp", cfg.dense_intermediate_size)


def build(config: KimiK3Config | None = None, rank: int = 0, world: int = 1, group=None,
          dtype=torch.bfloat16) -> KimiK3ForCausalLM:
    config = config or tiny_config()
    K3W.check_world(config, world)
    tp = TensorParallel(rank, world, group)
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config, tp)
    model = model.to_empty(device="cpu").to(dtype)
    _load(model, K3W.full_weights(config, dtype))
    model.eval()
    for prm in model.parameters():
        prm.requires_grad_(False)
    return model
