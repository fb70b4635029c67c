"""Shared tiny config, deterministic full weights and initial decode cache for the three styles.

Every rank calls `full_weights(cfg)` and gets the same FULL (unsharded) tensors; each style slices its
own tensor-parallel shard. Names here are canonical; each style re-packs them in its own layout.

Canonical layouts (row = output feature, like nn.Linear.weight):
  embed [V, H], lm_head [V, H], final.{w_norm,w_qk,g} [H]
  layers.{l}.pre.{w_norm,w_qk,g}, layers.{l}.post.{w_norm,w_qk,g}    AttnRes mixers (g = g_in / g_post)
  KDA:  q,k,v,g [NH*D, H]; beta [NH, H]; f_a [R, H]; f_b [NH*D, R]; conv_q/k/v [NH*D, W];
        A_log [NH] fp32; dt_bias [NH*D] fp32; o_norm [D]; o_proj [H, NH*D]
  MLA:  q_a [QL, H]; kv_a [KL+RoPE, H]; gate [NH*V, H]; q_a_norm [QL]; kv_a_norm [KL];
        q_b [NH*(Nope+RoPE), QL] (per head: nope then rope); kv_b [NH*(Nope+V), KL] (per head:
        W_UK rows then W_UV rows); o_proj [H, NH*V]
  dense MLP: mlp.gate_up [2*I, H] ([gate; up]); mlp.down [H, I]
  MoE:  router [E, H] bf16; router_bias [E] fp32; lat_down [L, H]; lat_norm [L]; lat_up [H, L];
        w13 [E, 2*I, L/2] uint8, w13_scale [E, 2*I, L/32] uint8 (rows: [gate; up]);
        w2 [E, L, I/2] uint8, w2_scale [E, L, I/32] uint8;
        shared.gate_up [2*S, H]; shared.down [H, S]
  MXFP4: E2M1 codes two per byte, low nibble = even K index; one E8M0 byte per 32 K, value 2^(s-127).

Cache (full, per batch M):
  pos [M] int64: tokens already in the MLA latent cache per sequence (the new token goes at pos)
  layers.{l}.conv_q/k/v [M, NH*D, W-1] (oldest first), layers.{l}.state [M, NH, Dv, Dk] fp32 (KDA)
  layers.{l}.kv [M, T, KL+RoPE] (MLA latent cache: normalised c_kv then k_pe; rows >= pos are zero)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class K3TinyConfig:
    hidden_size: int = 128
    vocab_size: int = 256
    # "kda" / "mla" per layer; layers in dense_layers use the dense SiTU MLP, the others LatentMoE
    layer_types: tuple = ("kda", "kda", "mla", "kda")
    dense_layers: tuple = (0,)
    rms_norm_eps: float = 1e-5
    l2norm_eps: float = 1e-6
    # KDA
    kda_num_heads: int = 4
    kda_head_dim: int = 16
    kda_conv_size: int = 4
    kda_gate_rank: int = 16
    kda_gate_lower_bound: float = -5.0
    # MLA
    mla_num_heads: int = 4
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    max_cache_len: int = 16
    # dense MLP / LatentMoE
    dense_intermediate_size: int = 128
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64      # per rank it must stay a multiple of 32 (MXFP4 K block of W2)
    moe_latent_size: int = 64
    shared_intermediate_size: int = 64
    routed_scaling_factor: float = 1.0
    router_renorm_eps: float = 1e-20
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # AttnRes: the pre-attention mixer of every layer l with l % block_size == 0 stores `updated`
    attn_res_block_size: int = 2
    attn_res_max_blocks: int = 8
    mxfp4_block: int = 32
    seed: int = 0

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    def is_dense(self, layer: int) -> bool:
        return layer in self.dense_layers

    def writes_block(self, layer: int) -> bool:
        return layer % self.attn_res_block_size == 0

    def n_blocks(self) -> int:
        return sum(self.writes_block(i) for i in range(self.num_hidden_layers))


def tiny_config(**overrides) -> K3TinyConfig:
    cfg = dataclasses.replace(K3TinyConfig(), **overrides)
    if isinstance(cfg.layer_types, list):
        cfg = dataclasses.replace(cfg, layer_types=tuple(cfg.layer_types))
    assert cfg.n_blocks() <= cfg.attn_res_max_blocks
    assert cfg.moe_latent_size % cfg.mxfp4_block == 0
    return cfg


def spec_layer_types(n_layers: int, mla_every: int = 4) -> tuple:
    """The spec's rule: 1-indexed every 4th layer and the last one are MLA."""
    return tuple("mla" if (i + 1) % mla_every == 0 or i == n_layers - 1 else "kda"
                 for i in range(n_layers))


def check_world(cfg: K3TinyConfig, world: int) -> None:
    assert cfg.kda_num_heads % world == 0 and cfg.mla_num_heads % world == 0
    assert cfg.hidden_size % world == 0
    assert cfg.dense_intermediate_size % world == 0 and cfg.shared_intermediate_size % world == 0
    assert (cfg.moe_intermediate_size // world) % cfg.mxfp4_block == 0, \
        "each rank's W2 K-slice must hold whole MXFP4 scale blocks"


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _randn(g, *shape, std=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * std).to(dtype)


def _norm_w(g, n, dtype=torch.bfloat16):
    return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)


def _lin(g, out_f, in_f, dtype=torch.bfloat16, gain=1.0):
    return _randn(g, out_f, in_f, std=gain / in_f ** 0.5, dtype=dtype)


def _mxfp4(g, e, n, k, block):
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    # 2^(s-127) in [2^-7, 2^-2]: E2M1 codes have rms ~2.9, so rows over K=64 give O(1) outputs
    scales = torch.randint(120, 126, (e, n, k // block), generator=g, dtype=torch.int32).to(torch.uint8)
    return codes, scales


def full_weights(cfg: K3TinyConfig, dtype=torch.bfloat16) -> dict:
    g = _gen(cfg.seed)
    H, V = cfg.hidden_size, cfg.vocab_size
    w = {}

    def mixer(prefix):
        w[f"{prefix}.w_norm"] = _norm_w(g, H, dtype)
        w[f"{prefix}.w_qk"] = _randn(g, H, std=1.0 / H ** 0.5, dtype=dtype)
        w[f"{prefix}.g"] = _norm_w(g, H, dtype)

    w["embed"] = _randn(g, V, H, dtype=dtype)
    for li, kind in enumerate(cfg.layer_types):
        p = f"layers.{li}"
        mixer(f"{p}.pre")
        mixer(f"{p}.post")
        if kind == "kda":
            NH, D, R, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_gate_rank, cfg.kda_conv_size
            for n in ("q", "k", "v", "g"):
                w[f"{p}.{n}"] = _lin(g, NH * D, H, dtype)
            w[f"{p}.beta"] = _lin(g, NH, H, dtype)
            w[f"{p}.f_a"] = _lin(g, R, H, dtype)
            w[f"{p}.f_b"] = _lin(g, NH * D, R, dtype)
            for n in ("q", "k", "v"):
                w[f"{p}.conv_{n}"] = _randn(g, NH * D, W, std=0.5, dtype=dtype)
            w[f"{p}.A_log"] = torch.log(torch.empty(NH).uniform_(0.5, 4.0, generator=g))
            w[f"{p}.dt_bias"] = 0.5 * torch.randn(NH * D, generator=g)
            w[f"{p}.o_norm"] = _norm_w(g, D, dtype)
            w[f"{p}.o_proj"] = _lin(g, H, NH * D, dtype)
        else:
            NH, QL, KL = cfg.mla_num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
            NOPE, ROPE, VD = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
            w[f"{p}.q_a"] = _lin(g, QL, H, dtype)
            w[f"{p}.kv_a"] = _lin(g, KL + ROPE, H, dtype)
            w[f"{p}.gate"] = _lin(g, NH * VD, H, dtype)
            w[f"{p}.q_a_norm"] = _norm_w(g, QL, dtype)
            w[f"{p}.kv_a_norm"] = _norm_w(g, KL, dtype)
            w[f"{p}.q_b"] = _lin(g, NH * (NOPE + ROPE), QL, dtype)
            w[f"{p}.kv_b"] = _lin(g, NH * (NOPE + VD), KL, dtype)
            w[f"{p}.o_proj"] = _lin(g, H, NH * VD, dtype)
        if cfg.is_dense(li):
            I = cfg.dense_intermediate_size
            w[f"{p}.mlp.gate_up"] = _lin(g, 2 * I, H, dtype)
            w[f"{p}.mlp.down"] = _lin(g, H, I, dtype)
        else:
            E, L, I, S = (cfg.n_routed_experts, cfg.moe_latent_size, cfg.moe_intermediate_size,
                          cfg.shared_intermediate_size)
            w[f"{p}.router"] = _lin(g, E, H, dtype, gain=1.5)
            w[f"{p}.router_bias"] = 0.1 * torch.randn(E, generator=g)
            w[f"{p}.lat_down"] = _lin(g, L, H, dtype)
            w[f"{p}.lat_norm"] = _norm_w(g, L, dtype)
            w[f"{p}.lat_up"] = _lin(g, H, L, dtype)
            w[f"{p}.w13"], w[f"{p}.w13_scale"] = _mxfp4(g, E, 2 * I, L, cfg.mxfp4_block)
            w[f"{p}.w2"], w[f"{p}.w2_scale"] = _mxfp4(g, E, L, I, cfg.mxfp4_block)
            w[f"{p}.shared.gate_up"] = _lin(g, 2 * S, H, dtype)
            w[f"{p}.shared.down"] = _lin(g, H, S, dtype)
    mixer("final")
    w["lm_head"] = _lin(g, V, H, dtype)
    return w


def init_lengths(cfg: K3TinyConfig, batch: int) -> torch.Tensor:
    """Existing MLA cache length per sequence (leaves room for a few decode steps)."""
    return torch.tensor([(5 + 4 * i) % (cfg.max_cache_len - 6) + 1 for i in range(batch)],
                        dtype=torch.int64)


def full_cache(cfg: K3TinyConfig, batch: int, dtype=torch.bfloat16) -> dict:
    g = _gen(cfg.seed * 7919 + 1000 + batch)
    c = {"pos": init_lengths(cfg, batch)}
    T = cfg.max_cache_len
    for li, kind in enumerate(cfg.layer_types):
        p = f"layers.{li}"
        if kind == "kda":
            NH, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
            for n in ("q", "k", "v"):
                c[f"{p}.conv_{n}"] = _randn(g, batch, NH * D, W - 1, dtype=dtype)
            c[f"{p}.state"] = 0.3 * torch.randn(batch, NH, D, D, generator=g)
        else:
            KL, ROPE = cfg.kv_lora_rank, cfg.qk_rope_head_dim
            kv = torch.randn(batch, T, KL + ROPE, generator=g)
            live = torch.arange(T)[None, :] < c["pos"][:, None]
            c[f"{p}.kv"] = (kv * live[..., None]).to(dtype)
    return c


def token_ids(cfg: K3TinyConfig, batch: int, step: int) -> torch.Tensor:
    g = _gen(cfg.seed * 31 + 17 * step + batch)
    return torch.randint(0, cfg.vocab_size, (batch,), generator=g, dtype=torch.int64)
