"""Kimi K3 decoder, functional style (written from /work/shared/K3-SPEC.md only).

Spellings on purpose:
  * Weights in a dataclass holding a flat dict of this rank's tensors; pure functions; `step` returns
    (logits, new_cache) and never mutates its inputs (cache updates via torch.where / torch.cat).
  * GEMMs as `x @ W.t()` and `torch.matmul(x, W.T)`; embedding as `W[ids]`.
  * RMSNorm by hand in fp32: `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`, cast back, THEN
    times the weight (bf16 multiply).
  * Residual as `delta + prefix`; AttnRes mixer unrolled: a Python loop over the blocks with a running
    max / exp / sum (no torch.stack, no torch.softmax).
  * KDA: one fused [q; k; v] matmul (g, beta, f_a separate), conv as an einsum over the window,
    L2 norm via rsqrt(sum(x*x) + eps), recurrence as einsums (outer products) on an fp32 state.
  * MLA: one fused qkv_a matmul (q_a | kv_a | gate shard) + torch.split; absorbed W_UK / W_UV as
    torch.bmm over heads; scores as bmm against the latent cache, masked_fill(-inf), torch.softmax.
  * Router: torch.matmul(x.float(), W.float().T), sigmoid, topk on scores + bias, gather, renorm.
  * Routed experts in plain torch: gather the top-k experts' packed codes and E8M0 scales, unpack the
    nibbles (& 0xF, >> 4), index an E2M1 lookup-table tensor, scale via torch.exp2(s - 127), einsum.
    Finalize as torch.bmm(w.unsqueeze(1), out).squeeze(1).
  * Tail: W_up shard output placed with F.pad, added to the shared partial (shared computed inline).
  * Collectives: torch.ops._c10d_functional.all_reduce(t, "sum", group_name) + wait_tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import weights as K3W

RETURNS_CACHE = True


def tiny_config(**overrides) -> K3W.K3TinyConfig:
    return K3W.tiny_config(**overrides)


@dataclass
class K3Weights:
    cfg: K3W.K3TinyConfig
    rank: int
    world: int
    group_name: str | None
    w: dict = field(default_factory=dict)

    def new_cache(self, batch: int) -> dict:
        return new_cache(self, batch)


# ------------------------------------------------------------------------------------------------
# building blocks
# ------------------------------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def all_reduce(x, W: K3Weights):
    if W.world == 1:
        return x
    y = torch.ops._c10d_functional.all_reduce(x, "sum", W.group_name)
    return torch.ops._c10d_functional.wait_tensor(y)


def situ(gate_up, cfg):
    n = gate_up.shape[-1] // 2
    gate = gate_up[..., :n].float()
    up = gate_up[..., n:].float()
    g = cfg.situ_beta * torch.tanh(gate / cfg.situ_beta) * torch.sigmoid(gate)
    u = cfg.situ_linear_beta * torch.tanh(up / cfg.situ_linear_beta)
    return g * u


def attn_res(prefix, delta, blocks, w, p, eps):
    """Returns (normed mixer output, updated residual)."""
    updated = prefix if delta is None else delta + prefix
    if len(blocks) == 0:
        mixed = updated
    else:
        sources = list(blocks) + [updated]
        query = w[f"{p}.w_qk"].float()
        logits = []
        for s in sources:
            logits.append((rms_norm(s, w[f"{p}.w_norm"], eps).float() * query).sum(-1))   # [M]
        running_max = logits[0]
        for lg in logits[1:]:
            running_max = torch.maximum(running_max, lg)
        num = None
        den = None
        for lg, s in zip(logits, sources):
            e = torch.exp(lg - running_max)
            term = e.unsqueeze(-1) * s.float()
            num = term if num is None else num + term
            den = e if den is None else den + e
        mixed = (num / den.unsqueeze(-1)).to(updated.dtype)
    return rms_norm(mixed, w[f"{p}.g"], eps), updated


def mxfp4_dequant(codes, scales, lut):
    """codes [..., N, K/2] uint8, scales [..., N, K/32] uint8 -> [..., N, K] fp32."""
    low = codes & 0xF
    high = codes >> 4
    idx = torch.stack([low, high], dim=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    vals = lut[idx.long()]
    nblk = scales.shape[-1]
    vals = vals.reshape(*codes.shape[:-1], nblk, vals.shape[-1] // nblk)
    scale = torch.exp2(scales.float() - 127.0)
    return (vals * scale.unsqueeze(-1)).reshape(*codes.shape[:-1], -1)


# ------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------

def kda(x, W: K3Weights, p, cache, new):
    cfg, w = W.cfg, W.w
    M = x.shape[0]
    nh, d = cfg.kda_num_heads // W.world, cfg.kda_head_dim
    C = nh * d
    qkv = x @ w[f"{p}.qkv"].t()                                  # [M, 3C]
    window = torch.cat([cache[f"{p}.conv"], qkv.unsqueeze(-1)], dim=-1)   # [M, 3C, W]
    new[f"{p}.conv"] = window[:, :, 1:].contiguous()       # stable strides step to step
    qkv = F.silu(torch.einsum("mcw,cw->mc", window.float(), w[f"{p}.conv"].float()))
    q, k, v = qkv.to(x.dtype).float().view(M, 3, nh, d).unbind(1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + cfg.l2norm_eps) * (d ** -0.5)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + cfg.l2norm_eps)

    fb = ((x @ w[f"{p}.f_a"].t()) @ w[f"{p}.f_b"].t()).float().view(M, nh, d)
    a = torch.exp(w[f"{p}.A_log"]).view(1, nh, 1)
    log_decay = cfg.kda_gate_lower_bound * torch.sigmoid(a * (fb + w[f"{p}.dt_bias"].view(1, nh, d)))
    decay = torch.exp(log_decay)
    beta = torch.sigmoid((x @ w[f"{p}.beta"].t()).float())     # [M, nh]

    S = cache[f"{p}.state"] * decay.unsqueeze(2)                 # [M, nh, dv, dk]
    pred = torch.einsum("mhvk,mhk->mhv", S, k)
    S = S + torch.einsum("mhv,mhk->mhvk", beta.unsqueeze(-1) * (v - pred), k)
    o = torch.einsum("mhvk,mhk->mhv", S, q)
    new[f"{p}.state"] = S

    o = rms_norm(o, w[f"{p}.o_norm"], cfg.rms_norm_eps)           # fp32 in, fp32 out
    g = torch.sigmoid((x @ w[f"{p}.g"].t()).float()).view(M, nh, d)
    o = (o * g).to(x.dtype).reshape(M, C)
    return all_reduce(torch.matmul(o, w[f"{p}.o_proj"].T), W)


def mla(x, W: K3Weights, p, cache, new):
    cfg, w = W.cfg, W.w
    M = x.shape[0]
    nh = cfg.mla_num_heads // W.world
    QL, KL, ROPE = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    NOPE, VD = cfg.qk_nope_head_dim, cfg.v_head_dim
    q_a, c_kv, k_pe, gate = torch.split(x @ w[f"{p}.qkv_a"].t(), [QL, KL, ROPE, nh * VD], dim=-1)
    q = rms_norm(q_a, w[f"{p}.q_a_norm"], cfg.rms_norm_eps) @ w[f"{p}.q_b"].t()
    q = q.view(M, nh, NOPE + ROPE)
    q_nope, q_pe = q[..., :NOPE], q[..., NOPE:]
    c_kv = rms_norm(c_kv, w[f"{p}.kv_a_norm"], cfg.rms_norm_eps)

    pos = cache["pos"]
    kv = cache[f"{p}.kv"]                                        # [M, T, KL + ROPE]
    T = kv.shape[1]
    t_idx = torch.arange(T, device=pos.device).unsqueeze(0)
    here = (t_idx == pos.unsqueeze(1)).unsqueeze(-1)
    kv = torch.where(here, torch.cat([c_kv, k_pe], dim=-1).unsqueeze(1), kv)
    new[f"{p}.kv"] = kv

    w_uk = w[f"{p}.w_uk"]                                        # [nh, NOPE, KL]
    w_uv = w[f"{p}.w_uv"]                                        # [nh, VD, KL]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)      # [M, nh, KL]
    q_full = torch.cat([q_lat, q_pe], dim=-1).float()
    scores = torch.bmm(q_full, kv.float().transpose(1, 2)) * (NOPE + ROPE) ** -0.5   # [M, nh, T]
    scores = scores.masked_fill((t_idx > pos.unsqueeze(1)).unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o_lat = torch.bmm(probs, kv[..., :KL].float()).to(x.dtype)           # [M, nh, KL]
    o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)   # [M, nh, VD]
    o = (o.float() * torch.sigmoid(gate.float()).view(M, nh, VD)).to(x.dtype)
    return all_reduce(o.reshape(M, nh * VD) @ w[f"{p}.o_proj"].t(), W)


# ------------------------------------------------------------------------------------------------
# MLP / MoE
# ------------------------------------------------------------------------------------------------

def dense_mlp(x, W: K3Weights, p):
    h = situ(x @ W.w[f"{p}.mlp.gate_up"].t(), W.cfg).to(x.dtype)
    return all_reduce(h @ W.w[f"{p}.mlp.down"].t(), W)


def latent_moe(x, W: K3Weights, p):
    cfg, w = W.cfg, W.w
    M = x.shape[0]
    K = cfg.num_experts_per_tok
    # router (replicated, fp32)
    scores = torch.sigmoid(torch.matmul(x.float(), w[f"{p}.router"].float().T))
    _, ids = torch.topk(scores + w[f"{p}.router_bias"], K, dim=-1)
    tw = torch.gather(scores, 1, ids)
    tw = tw / (tw.sum(-1, keepdim=True) + cfg.router_renorm_eps) * cfg.routed_scaling_factor
    # latent down (replicated)
    lat = x @ w[f"{p}.lat_down"].t()                               # [M, L]
    # routed experts: gather, dequantise in the graph, einsum
    lut = w["e2m1_lut"]
    w13 = mxfp4_dequant(w[f"{p}.w13"][ids], w[f"{p}.w13_scale"][ids], lut)     # [M, K, 2I, L]
    ug = torch.einsum("ml,mknl->mkn", lat.float(), w13)
    mid = situ(ug, cfg).to(x.dtype).float()                                     # [M, K, I]
    w2 = mxfp4_dequant(w[f"{p}.w2"][ids], w[f"{p}.w2_scale"][ids], lut)       # [M, K, L, I]
    out = torch.einsum("mki,mkli->mkl", mid, w2).to(x.dtype)                    # [M, K, L]
    routed = torch.bmm(tw.unsqueeze(1), out.float()).squeeze(1).to(x.dtype)     # [M, L]
    routed = all_reduce(routed, W)
    ln = rms_norm(routed, w[f"{p}.lat_norm"], cfg.rms_norm_eps)
    tail = ln @ w[f"{p}.lat_up"].t()                               # [M, H/t]
    # shared expert inline
    shared = situ(x @ w[f"{p}.shared.gate_up"].t(), cfg).to(x.dtype) @ w[f"{p}.shared.down"].t()
    H, hs = cfg.hidden_size, tail.shape[-1]
    final = shared + F.pad(tail, (W.rank * hs, H - (W.rank + 1) * hs))
    return all_reduce(final, W)


# ------------------------------------------------------------------------------------------------
# step
# ------------------------------------------------------------------------------------------------

def step(W: K3Weights, ids: torch.Tensor, cache: dict):
    """One decode token per sequence. Returns (fp32 logits [M, V], new cache dict)."""
    cfg, w = W.cfg, W.w
    eps = cfg.rms_norm_eps
    new = dict(cache)
    prefix = w["embed"][ids]
    delta = None
    blocks = []
    for li, kind in enumerate(cfg.layer_types):
        p = f"layers.{li}"
        x, prefix = attn_res(prefix, delta, blocks, w, f"{p}.pre", eps)
        if cfg.writes_block(li):
            blocks.append(prefix)
        a = kda(x, W, p, cache, new) if kind == "kda" else mla(x, W, p, cache, new)
        x, prefix = attn_res(prefix, a, blocks, w, f"{p}.post", eps)
        delta = dense_mlp(x, W, p) if cfg.is_dense(li) else latent_moe(x, W, p)
    x, _ = attn_res(prefix, delta, blocks, w, "final", eps)
    logits = torch.matmul(x, w["lm_head"].T).float()
    new["pos"] = cache["pos"] + 1
    return logits, new


# ------------------------------------------------------------------------------------------------
# weights / cache
# ------------------------------------------------------------------------------------------------

def _shard(full: dict, cfg, r: int, t: int) -> dict:
    def rows(x):
        n = x.shape[0] // t
        return x[r * n:(r + 1) * n]

    def cols(x):
        n = x.shape[1] // t
        return x[:, r * n:(r + 1) * n]

    def gate_up(x):
        g, u = x.chunk(2, 0)
        return torch.cat([rows(g), rows(u)], 0)

    w = {"embed": full["embed"], "lm_head": full["lm_head"],
         "e2m1_lut": torch.tensor(K3W.E2M1_VALUES, dtype=torch.float32)}
    for n in ("w_norm", "w_qk", "g"):
        w[f"final.{n}"] = full[f"final.{n}"]
    for li, kind in enumerate(cfg.layer_types):
        p = f"layers.{li}"
        for m in ("pre", "post"):
            for n in ("w_norm", "w_qk", "g"):
                w[f"{p}.{m}.{n}"] = full[f"{p}.{m}.{n}"]
        if kind == "kda":
            w[f"{p}.qkv"] = torch.cat([rows(full[f"{p}.{n}"]) for n in "qkv"], 0)
            w[f"{p}.conv"] = torch.cat([rows(full[f"{p}.conv_{n}"]) for n in "qkv"], 0)
            for n in ("g", "beta", "f_b", "A_log", "dt_bias"):
                w[f"{p}.{n}"] = rows(full[f"{p}.{n}"])
            w[f"{p}.f_a"] = full[f"{p}.f_a"]
            w[f"{p}.o_norm"] = full[f"{p}.o_norm"]
            w[f"{p}.o_proj"] = cols(full[f"{p}.o_proj"])
        else:
            nh = cfg.mla_num_heads // t
            w[f"{p}.qkv_a"] = torch.cat([full[f"{p}.q_a"], full[f"{p}.kv_a"], rows(full[f"{p}.gate"])], 0)
            w[f"{p}.q_a_norm"] = full[f"{p}.q_a_norm"]
            w[f"{p}.kv_a_norm"] = full[f"{p}.kv_a_norm"]
            w[f"{p}.q_b"] = rows(full[f"{p}.q_b"])
            kv_b = rows(full[f"{p}.kv_b"]).view(nh, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            w[f"{p}.w_uk"] = kv_b[:, :cfg.qk_nope_head_dim].contiguous()
            w[f"{p}.w_uv"] = kv_b[:, cfg.qk_nope_head_dim:].contiguous()
            w[f"{p}.o_proj"] = cols(full[f"{p}.o_proj"])
        if cfg.is_dense(li):
            w[f"{p}.mlp.gate_up"] = gate_up(full[f"{p}.mlp.gate_up"])
            w[f"{p}.mlp.down"] = cols(full[f"{p}.mlp.down"])
        else:
            for n in ("router", "router_bias", "lat_down", "lat_norm"):
                w[f"{p}.{n}"] = full[f"{p}.{n}"]
            w[f"{p}.lat_up"] = rows(full[f"{p}.lat_up"])
            for n in ("w13", "w13_scale"):
                g, u = full[f"{p}.{n}"].chunk(2, 1)
                w[f"{p}.{n}"] = torch.cat([g.chunk(t, 1)[r], u.chunk(t, 1)[r]], 1)
            for n in ("w2", "w2_scale"):
                w[f"{p}.{n}"] = full[f"{p}.{n}"].chunk(t, 2)[r]
            w[f"{p}.shared.gate_up"] = gate_up(full[f"{p}.shared.gate_up"])
            w[f"{p}.shared.down"] = cols(full[f"{p}.shared.down"])
    return {k: v.contiguous() for k, v in w.items()}


def build(config=None, rank: int = 0, world: int = 1, group=None, dtype=torch.bfloat16) -> K3Weights:
    cfg = config or tiny_config()
    K3W.check_world(cfg, world)
    group_name = None
    if world > 1:
        group_name = (group if group is not None else dist.group.WORLD).group_name
    return K3Weights(cfg, rank, world, group_name, _shard(K3W.full_weights(cfg, dtype), cfg, rank, world))


def new_cache(W: K3Weights, batch: int) -> dict:
    cfg, r, t = W.cfg, W.rank, W.world
    full = K3W.full_cache(cfg, batch, W.w["embed"].dtype)
    c = {"pos": full["pos"]}
    for li, kind in enumerate(cfg.layer_types):
        p = f"layers.{li}"
        if kind == "kda":
            c[f"{p}.conv"] = torch.cat([full[f"{p}.conv_{n}"].chunk(t, 1)[r] for n in "qkv"], 1).contiguous()
            c[f"{p}.state"] = full[f"{p}.state"].chunk(t, 1)[r].contiguous()
        else:
            c[f"{p}.kv"] = full[f"{p}.kv"]
    return c
