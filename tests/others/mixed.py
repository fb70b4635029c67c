"""Kimi K3 decoder, functional style with the SPELLING of each component chosen per layer.

Same weights, cache and math as functional.py (its `build` / `new_cache` / building blocks are reused),
but `step(W, ids, cache, spellings)` takes one dict per layer (see SPELLINGS) choosing how that layer's
GEMMs, RMSNorms, residual add, all-reduces, router renormalisation, MoE finalize, latent-tail add and
AttnRes mixer are written. The final mixer (after the last layer) uses the last layer's spellings.
Used by tests/test_spellings.py to check that the k3 backend's matching does not depend on how a
decoder is written.

Spelling keys and values:
  gemm       "linear"     F.linear(x, W)
             "matmul_op"  x @ W.t()
             "matmul_fn"  torch.matmul(x, W.T)
             "mm"         torch.mm(x.view(-1, K), W.t()).view(..., N)
  norm       "rms_norm"   F.rms_norm(x, (H,), w, eps) (in eager: the weight applied in fp32, one rounding)
             "fused_rms_norm" F.rms_norm as a CUDA compile traces it: rms_norm reaches aten._fused_rms_norm
                          (a CUDA kernel), which AOT decomposes with torch._decomp's `_fused_rms_norm`
                          (add.Scalar eps, the bf16 weight multiplied into the fp32 result, type_as)
             "rsqrt_after" fp32 x * rsqrt(mean(x^2) + eps), cast back, THEN * w   (functional.py)
             "sqrt_before" fp32 x / sqrt(var + eps), w multiplied in fp32 BEFORE the cast (fused.py)
             "module_recip" an nn.Module (transformers style): fp32 x * (1 / sqrt(...)), cast back, w * that
             "in_dtype"   every step in the model dtype (no fp32 upcast): x * rsqrt(mean(x^2) + eps) * w
  residual   "prefix_delta" prefix + delta | "delta_prefix" delta + prefix | "torch_add" torch.add(prefix, delta)
  allreduce  (world > 1 only)
             "funcol"     torch.distributed._functional_collectives.all_reduce(t, "sum", group)
             "c10d"       torch.ops._c10d_functional.all_reduce(t, "sum", name) + wait_tensor
             "inplace"    dist.all_reduce(t, group=group), then t is used
  router     "bf16"       router GEMM in the model dtype (the layer's gemm spelling), then .float()
             "fp32"       torch.matmul(x.float(), W.float().T)
  shared     "fused"      one [gate; up] GEMM, SiTU over its halves
             "split"      separate gate and up GEMMs (weights split at build), SiTU(gate, up)
  dequant    "table_input" E2M1 value table passed in as a weight, scale exp2(s - 127)   (functional.py)
             "table_const" torch.tensor(E2M1 values) made in the step, scale ldexp(1, s - 127)
             "bits"       sign / exponent / mantissa decoded by arithmetic, scale pow(2, s - 127)
  renorm     "plain"      w / w.sum(-1, keepdim=True)
             "eps"        w / (w.sum(-1, keepdim=True) + 1e-20)
             "scale"      w * (scale / (w.sum(-1, keepdim=True) + eps))
  finalize   "mul_sum"    (y * w.unsqueeze(-1)).sum(1)
             "bmm"        torch.bmm(w.unsqueeze(1), y).squeeze(1)
             "einsum"     torch.einsum("mk,mkd->md", w, y)
  tail       "pad"        shared + F.pad(tail, (lo, H - hi))
             "slice_iadd" out = shared.clone(); out[:, lo:hi] += tail
             "narrow_add_" shared.narrow(1, lo, n).add_(tail)
  mixer      "stack_softmax" softmax over torch.stack(sources), weighted sum
             "unrolled"   running max / exp / sum over the sources (functional.py)
  keys       the AttnRes logits (each source's key, normed as the layer's `norm` spells it):
             "weighted"   RMSNorm(src, w_norm) (the layer's norm with w_norm as its weight) . w_qk  (functional.py)
             "rounded"    RMSNorm(src) rounded to the model dtype, . (w_norm * w_qk) (the reference model's)
             "fp32"       RMSNorm(src) kept in fp32, . (w_norm * w_qk)

The KDA / MLA cores and the MXFP4 experts are functional.py's, with the layer's GEMM and RMSNorm
spellings substituted.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from . import functional as FN
from . import weights as K3W

RETURNS_CACHE = True

SPELLINGS = {
    "gemm": ("linear", "matmul_op", "matmul_fn", "mm"),
    "norm": ("rms_norm", "fused_rms_norm", "rsqrt_after", "sqrt_before", "module_recip", "in_dtype"),
    "residual": ("prefix_delta", "delta_prefix", "torch_add"),
    "allreduce": ("funcol", "c10d", "inplace"),
    "renorm": ("plain", "eps", "scale"),
    "finalize": ("mul_sum", "bmm", "einsum"),
    "tail": ("pad", "slice_iadd", "narrow_add_"),
    "mixer": ("stack_softmax", "unrolled"),
    "keys": ("weighted", "rounded", "fp32"),
    "router": ("bf16", "fp32"),
    "shared": ("fused", "split"),
    "dequant": ("table_input", "table_const", "bits"),
}
# functional.py's own spellings (its router is the fp32 one)
FUNCTIONAL = dict(gemm="matmul_op", norm="rsqrt_after", residual="delta_prefix", allreduce="c10d",
                  renorm="eps", finalize="bmm", tail="pad", mixer="unrolled", keys="weighted", router="fp32",
                  shared="fused", dequant="table_input")
DEFAULT = dict(FUNCTIONAL, router="bf16")

tiny_config = FN.tiny_config


def build(*args, **kwargs):
    """functional.py's weights, plus each shared expert's gate and up halves as weights of their own
    (for the "split" spelling)."""
    W = FN.build(*args, **kwargs)
    for k in [k for k in W.w if k.endswith(".shared.gate_up")]:
        gate, up = W.w[k].chunk(2, 0)
        W.w[k.replace("gate_up", "gate")], W.w[k.replace("gate_up", "up")] = gate.contiguous(), up.contiguous()
    return W


new_cache = FN.new_cache


def complete(sp: dict) -> dict:
    """The spelling dict with every key present (missing keys: DEFAULT); rejects unknown values."""
    out = dict(DEFAULT, **sp)
    for k, v in out.items():
        assert k in SPELLINGS and v in SPELLINGS[k], (k, v)
    return out


# ------------------------------------------------------------------------------------------------
# spelled building blocks
# ------------------------------------------------------------------------------------------------

def gemm(x, W, sp):
    f = sp["gemm"]
    if f == "linear":
        return F.linear(x, W)
    if f == "matmul_op":
        return x @ W.t()
    if f == "matmul_fn":
        return torch.matmul(x, W.T)
    K = x.shape[-1]
    return torch.mm(x.view(-1, K), W.t()).view(*x.shape[:-1], W.shape[0])


class RecipRMSNorm(torch.nn.Module):
    """A transformers-style RMSNorm module: fp32 statistics, x * (1 / sqrt(...)), the weight after the cast."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * (1.0 / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
        return h.to(x.dtype) if self.weight is None else self.weight * h.to(x.dtype)


def normalised(x, eps, sp):
    """x's RMS normalisation in fp32 (no weight, not rounded), as the layer's norm spelling computes it."""
    f = sp["norm"]
    xf = x.float()
    ms = xf.pow(2).mean(-1, keepdim=True) + eps
    if f == "sqrt_before":
        return xf / torch.sqrt(ms)
    if f == "module_recip":
        return xf * (1.0 / torch.sqrt(ms))
    return xf * torch.rsqrt(ms)


def rms_norm(x, w, eps, sp):
    """The layer's RMSNorm spelling of x with weight w (None: no weight), in x's dtype."""
    f = sp["norm"]
    if f == "rms_norm":
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    if f == "fused_rms_norm":
        from torch._decomp.decompositions import _fused_rms_norm
        return _fused_rms_norm(x, [x.shape[-1]], w, eps)[0]
    if f == "module_recip":
        return RecipRMSNorm(w, eps)(x)
    if f == "in_dtype":
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y if w is None else y * w
    xf = x.float()
    if f == "rsqrt_after":
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return y if w is None else y * w
    var = xf.pow(2).mean(-1, keepdim=True)
    y = xf / torch.sqrt(var + eps)
    return (y if w is None else w.float() * y).to(x.dtype)


def mixer_key_logit(src, w, p, eps, sp):
    """One source's (or the stacked sources') AttnRes logits [..., M] (fp32), the key formed as sp["keys"] says."""
    f = sp["keys"]
    if f == "weighted":
        return (rms_norm(src, w[f"{p}.w_norm"], eps, sp).float() * w[f"{p}.w_qk"].float()).sum(-1)
    query = w[f"{p}.w_norm"].float() * w[f"{p}.w_qk"].float()
    key = rms_norm(src, None, eps, sp).float() if f == "rounded" else normalised(src, eps, sp)
    return (key * query).sum(-1)


def residual(prefix, delta, sp):
    f = sp["residual"]
    if f == "prefix_delta":
        return prefix + delta
    if f == "delta_prefix":
        return delta + prefix
    return torch.add(prefix, delta)


def all_reduce(t, W, sp):
    if W.world == 1:
        return t
    f = sp["allreduce"]
    if f == "funcol":
        return funcol.all_reduce(t, "sum", W.group)
    if f == "c10d":
        return torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(t, "sum", W.group_name))
    dist.all_reduce(t, group=W.group)
    return t


def attn_res(prefix, delta, blocks, w, p, eps, sp):
    """Returns (normed mixer output, updated residual)."""
    updated = prefix if delta is None else residual(prefix, delta, sp)
    if len(blocks) == 0:
        mixed = updated
    elif sp["mixer"] == "stack_softmax":
        src = torch.stack(list(blocks) + [updated])                                  # [S, M, H]
        logits = mixer_key_logit(src, w, p, eps, sp)
        probs = torch.softmax(logits, dim=0)                                           # [S, M]
        mixed = (probs.unsqueeze(-1) * src.float()).sum(0).to(updated.dtype)
    else:
        sources = list(blocks) + [updated]
        logits = [mixer_key_logit(s, w, p, eps, sp) for s in sources]
        running_max = logits[0]
        for lg in logits[1:]:
            running_max = torch.maximum(running_max, lg)
        num = den = None
        for lg, s in zip(logits, sources):
            e = torch.exp(lg - running_max)
            term = e.unsqueeze(-1) * s.float()
            num = term if num is None else num + term
            den = e if den is None else den + e
        mixed = (num / den.unsqueeze(-1)).to(updated.dtype)
    return rms_norm(mixed, w[f"{p}.g"], eps, sp), updated


# ------------------------------------------------------------------------------------------------
# attention (functional.py's cores, spelled GEMMs / norms / all-reduce)
# ------------------------------------------------------------------------------------------------

def kda(x, W, p, cache, new, sp):
    cfg, w = W.cfg, W.w
    M = x.shape[0]
    nh, d = cfg.kda_num_heads // W.world, cfg.kda_head_dim
    C = nh * d
    qkv = gemm(x, w[f"{p}.qkv"], sp)
    window = torch.cat([cache[f"{p}.conv"], qkv.unsqueeze(-1)], dim=-1)
    new[f"{p}.conv"] = window[:, :, 1:].contiguous()
    qkv = F.silu(torch.einsum("mcw,cw->mc", window.float(), w[f"{p}.conv"].float()))
    q, k, v = qkv.to(x.dtype).float().view(M, 3, nh, d).unbind(1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + cfg.l2norm_eps) * (d ** -0.5)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + cfg.l2norm_eps)

    fb = gemm(gemm(x, w[f"{p}.f_a"], sp), w[f"{p}.f_b"], sp).float().view(M, nh, d)
    a = torch.exp(w[f"{p}.A_log"]).view(1, nh, 1)
    log_decay = cfg.kda_gate_lower_bound * torch.sigmoid(a * (fb + w[f"{p}.dt_bias"].view(1, nh, d)))
    decay = torch.exp(log_decay)
    beta = torch.sigmoid(gemm(x, w[f"{p}.beta"], sp).float())

    S = cache[f"{p}.state"] * decay.unsqueeze(2)
    pred = torch.einsum("mhvk,mhk->mhv", S, k)
    S = S + torch.einsum("mhv,mhk->mhvk", beta.unsqueeze(-1) * (v - pred), k)
    o = torch.einsum("mhvk,mhk->mhv", S, q)
    new[f"{p}.state"] = S

    o = FN.rms_norm(o, w[f"{p}.o_norm"], cfg.rms_norm_eps)        # fp32 per-head norm, as functional.py
    g = torch.sigmoid(gemm(x, w[f"{p}.g"], sp).float()).view(M, nh, d)
    o = (o * g).to(x.dtype).reshape(M, C)
    return all_reduce(gemm(o, w[f"{p}.o_proj"], sp), W, sp)


def mla(x, W, p, cache, new, sp):
    cfg, w = W.cfg, W.w
    M = x.shape[0]
    nh = cfg.mla_num_heads // W.world
    QL, KL, ROPE = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    NOPE, VD = cfg.qk_nope_head_dim, cfg.v_head_dim
    eps = cfg.rms_norm_eps
    q_a, c_kv, k_pe, gate = torch.split(gemm(x, w[f"{p}.qkv_a"], sp), [QL, KL, ROPE, nh * VD], dim=-1)
    q = gemm(rms_norm(q_a, w[f"{p}.q_a_norm"], eps, sp), w[f"{p}.q_b"], sp)
    q = q.view(M, nh, NOPE + ROPE)
    q_nope, q_pe = q[..., :NOPE], q[..., NOPE:]
    c_kv = rms_norm(c_kv, w[f"{p}.kv_a_norm"], eps, sp)

    pos = cache["pos"]
    kv = cache[f"{p}.kv"]
    T = kv.shape[1]
    t_idx = torch.arange(T, device=pos.device).unsqueeze(0)
    here = (t_idx == pos.unsqueeze(1)).unsqueeze(-1)
    kv = torch.where(here, torch.cat([c_kv, k_pe], dim=-1).unsqueeze(1), kv)
    new[f"{p}.kv"] = kv

    q_lat = torch.bmm(q_nope.transpose(0, 1), w[f"{p}.w_uk"]).transpose(0, 1)
    q_full = torch.cat([q_lat, q_pe], dim=-1).float()
    scores = torch.bmm(q_full, kv.float().transpose(1, 2)) * (NOPE + ROPE) ** -0.5
    scores = scores.masked_fill((t_idx > pos.unsqueeze(1)).unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o_lat = torch.bmm(probs, kv[..., :KL].float()).to(x.dtype)
    o = torch.bmm(o_lat.transpose(0, 1), w[f"{p}.w_uv"].transpose(1, 2)).transpose(0, 1)
    o = (o.float() * torch.sigmoid(gate.float()).view(M, nh, VD)).to(x.dtype)
    return all_reduce(gemm(o.reshape(M, nh * VD), w[f"{p}.o_proj"], sp), W, sp)


# ------------------------------------------------------------------------------------------------
# MLP / MoE
# ------------------------------------------------------------------------------------------------

def dense_mlp(x, W, p, sp):
    h = FN.situ(gemm(x, W.w[f"{p}.mlp.gate_up"], sp), W.cfg).to(x.dtype)
    return all_reduce(gemm(h, W.w[f"{p}.mlp.down"], sp), W, sp)


def renorm(tw, cfg, sp):
    f = sp["renorm"]
    if f == "plain":
        out = tw / tw.sum(-1, keepdim=True)
    elif f == "eps":
        out = tw / (tw.sum(-1, keepdim=True) + 1e-20)
    else:
        return tw * (cfg.routed_scaling_factor / (tw.sum(-1, keepdim=True) + cfg.router_renorm_eps))
    return out if cfg.routed_scaling_factor == 1.0 else out * cfg.routed_scaling_factor


def finalize(tw, y, sp):
    """tw [M, K] fp32, y [M, K, L] fp32 -> [M, L] fp32."""
    f = sp["finalize"]
    if f == "mul_sum":
        return (y * tw.unsqueeze(-1)).sum(1)
    if f == "bmm":
        return torch.bmm(tw.unsqueeze(1), y).squeeze(1)
    return torch.einsum("mk,mkd->md", tw, y)


def tail_add(shared, tail, W, sp):
    H, hs = shared.shape[-1], tail.shape[-1]
    lo = W.rank * hs
    f = sp["tail"]
    if f == "pad":
        return shared + F.pad(tail, (lo, H - lo - hs))
    if f == "slice_iadd":
        out = shared.clone()
        out[:, lo:lo + hs] += tail
        return out
    shared.narrow(1, lo, hs).add_(tail)
    return shared


def dequant(codes, scales, W, sp):
    """codes [..., N, K/2] uint8 (low nibble first), scales [..., N, K/32] uint8 -> [..., N, K] fp32."""
    how = sp.get("dequant", "table_input")
    if how == "table_input":
        return FN.mxfp4_dequant(codes, scales, W.w["e2m1_lut"])
    nib = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)              # [..., N, K]
    if how == "table_const":
        vals = torch.tensor(K3W.E2M1_VALUES, dtype=torch.float32)[nib.long()]
        scale = torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.int() - 127)
    else:
        e, m = ((nib >> 1) & 3).float(), (nib & 1).float()
        mag = torch.where(e == 0, m * 0.5, (1.0 + m * 0.5) * torch.exp2(e - 1.0))
        vals = mag * (1.0 - 2.0 * (nib >> 3).float())
        scale = torch.pow(2.0, scales.float() - 127.0)
    vals = vals.unflatten(-1, (scales.shape[-1], -1)) * scale.unsqueeze(-1)
    return vals.flatten(-2)


def latent_moe(x, W, p, sp):
    cfg, w = W.cfg, W.w
    K = cfg.num_experts_per_tok
    if sp["router"] == "fp32":
        logits = torch.matmul(x.float(), w[f"{p}.router"].float().T)
    else:
        logits = gemm(x, w[f"{p}.router"], sp).float()
    scores = torch.sigmoid(logits)
    _, ids = torch.topk(scores + w[f"{p}.router_bias"], K, dim=-1)
    tw = renorm(torch.gather(scores, 1, ids), cfg, sp)
    lat = gemm(x, w[f"{p}.lat_down"], sp)
    w13 = dequant(w[f"{p}.w13"][ids], w[f"{p}.w13_scale"][ids], W, sp)
    ug = torch.einsum("ml,mknl->mkn", lat.float(), w13)
    mid = FN.situ(ug, cfg).to(x.dtype).float()
    w2 = dequant(w[f"{p}.w2"][ids], w[f"{p}.w2_scale"][ids], W, sp)
    out = torch.einsum("mki,mkli->mkl", mid, w2).to(x.dtype)
    routed = finalize(tw, out.float(), sp).to(x.dtype)
    routed = all_reduce(routed, W, sp)
    tail = gemm(rms_norm(routed, w[f"{p}.lat_norm"], cfg.rms_norm_eps, sp), w[f"{p}.lat_up"], sp)
    if sp.get("shared", "fused") == "split":
        g, u = gemm(x, w[f"{p}.shared.gate"], sp).float(), gemm(x, w[f"{p}.shared.up"], sp).float()
        act = (cfg.situ_beta * torch.tanh(g / cfg.situ_beta) * torch.sigmoid(g)
               * (cfg.situ_linear_beta * torch.tanh(u / cfg.situ_linear_beta)))
    else:
        act = FN.situ(gemm(x, w[f"{p}.shared.gate_up"], sp), cfg)
    shared = gemm(act.to(x.dtype), w[f"{p}.shared.down"], sp)
    return all_reduce(tail_add(shared, tail, W, sp), W, sp)


# ------------------------------------------------------------------------------------------------
# step
# ------------------------------------------------------------------------------------------------

def step(W, ids, cache, spellings):
    """One decode token per sequence; spellings: one dict per layer (missing keys: DEFAULT).
    Returns (fp32 logits [M, V], new cache dict); never mutates its inputs."""
    cfg, w = W.cfg, W.w
    assert len(spellings) == cfg.num_hidden_layers, (len(spellings), cfg.num_hidden_layers)
    sps = [complete(s) for s in spellings]
    eps = cfg.rms_norm_eps
    new = dict(cache)
    prefix = w["embed"][ids]
    delta = None
    blocks = []
    for li, kind in enumerate(cfg.layer_types):
        p, sp = f"layers.{li}", sps[li]
        x, prefix = attn_res(prefix, delta, blocks, w, f"{p}.pre", eps, sp)
        if cfg.writes_block(li):
            blocks.append(prefix)
        a = kda(x, W, p, cache, new, sp) if kind == "kda" else mla(x, W, p, cache, new, sp)
        x, prefix = attn_res(prefix, a, blocks, w, f"{p}.post", eps, sp)
        delta = dense_mlp(x, W, p, sp) if cfg.is_dense(li) else latent_moe(x, W, p, sp)
    x, _ = attn_res(prefix, delta, blocks, w, "final", eps, sps[-1])
    logits = gemm(x, w["lm_head"], sps[-1]).float()
    new["pos"] = cache["pos"] + 1
    return logits, new


# ------------------------------------------------------------------------------------------------
# driver (eager vs compiled), world 1 or spawned gloo ranks
# ------------------------------------------------------------------------------------------------

def _drive(W, cfg, M, steps, fn):
    cache = W.new_cache(M)
    outs = []
    for s in range(steps):
        logits, cache = fn(W, K3W.token_ids(cfg, M, s), cache)
        outs.append(logits.detach().clone())
    return torch.stack(outs)


def run(spellings, world: int = 1, rank: int = 0, M: int = 1, backend="k3-eager", steps: int = 2,
        cfg=None, group=None, dtype=torch.bfloat16, report: bool = True):
    """Eager vs compiled last-step logits of the mixed decoder. backend "k3-eager" is
    `k3compile.backend(mode="eager")` (dynamo reset and reports cleared first); None: eager only.
    Returns (eager, compiled or None[, report dict or None])."""
    cfg = cfg or tiny_config()
    spellings = [dict(s) for s in spellings]
    W = build(cfg, rank, world, group, dtype=dtype)
    # ProcessGroup for funcol / dist.all_reduce (functional.build keeps only the group name)
    W.group = None if world == 1 else (group if group is not None else dist.group.WORLD)

    def fn(W_, ids, cache):
        return step(W_, ids, cache, spellings)

    if backend == "k3-eager":
        import k3compile
        torch._dynamo.reset()
        k3compile.clear_reports()
        backend = k3compile.backend(mode="eager")
    with torch.no_grad():
        eager = _drive(W, cfg, M, steps, fn)[-1]
        compiled = None
        if backend is not None:
            compiled = _drive(W, cfg, M, steps, torch.compile(fn, backend=backend))[-1]
    if not report:
        return eager, compiled
    rep = None
    if backend is not None:
        import k3compile
        r = k3compile.last_report()
        rep = r.to_dict() if r is not None else None
    return eager, compiled, rep


def launch_many(jobs: list[dict], world: int = 2) -> list:
    """Each job (kwargs of `run` other than world/rank) on `world` spawned gloo ranks; rank 0's results."""
    from .run import launch_many as launch
    return launch(jobs, world, fn=run)
