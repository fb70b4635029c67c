"""Plain PyTorch reference implementations of the fused `k3::` ops (run on CPU and GPU).

Each computes exactly what the unfused K3 subgraph computes, with the same dtype roundings,
so a rewritten graph run on references equals the original graph up to kernel rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.model.functional import attnres_mix, rms_norm, situ, situ_mlp as shared_expert  # noqa: F401

from ..rounding import (MIX_BITS, MIX_DIV, MIX_KEY_FP32, MIX_KEY_WEIGHTED, MIX_SUM_FP32, NORM_BITS,  # noqa: F401
                        NORM_CAST_FIRST, NORM_DIV, NORM_IN_DTYPE, NORM_RECIP)


def _normalise(xf: torch.Tensor, eps: float, rounding: int) -> torch.Tensor:
    ms = xf.pow(2).mean(-1, keepdim=True) + eps
    if rounding & NORM_DIV:
        return xf / torch.sqrt(ms)
    if rounding & NORM_RECIP:
        return xf * torch.reciprocal(torch.sqrt(ms))
    return xf * torch.rsqrt(ms)


def rms_norm_as(x: torch.Tensor, w: torch.Tensor | None, eps: float, rounding: int = 0,
                round_out: bool = True) -> torch.Tensor:
    """RMSNorm of x (fp32 statistics) with the rounding order `rounding` (NORM_* bits), in x.dtype;
    round_out=False: the product with w left in fp32 (an AttnRes key kept in fp32)."""
    dt = x.dtype
    if rounding & NORM_IN_DTYPE:
        y = _normalise(x, eps, rounding)
        return y if w is None else y * w
    y = _normalise(x.float(), eps, rounding)
    if w is None:
        return y.to(dt) if round_out else y
    if rounding & NORM_CAST_FIRST:
        y = y.to(dt).float() * w.float()   # the product of two dt values: exact in fp32, rounded once below
    else:
        y = y * w.float()
    return y.to(dt) if round_out else y


def mix_logits(srcs: torch.Tensor, w_norm, w_qk, eps: float, mix_rounding: int = 0) -> torch.Tensor:
    """The AttnRes logits [S, M] of the stacked sources [S, M, H] (fp32), formed as `mix_rounding` says."""
    kr = mix_rounding & NORM_BITS
    fp32 = bool(mix_rounding & MIX_KEY_FP32)
    if mix_rounding & MIX_KEY_WEIGHTED:
        key = rms_norm_as(srcs, w_norm, eps, kr, round_out=not fp32).float()
        return (key * w_qk.float()).sum(-1)
    key = rms_norm_as(srcs, None, eps, kr, round_out=not fp32).float()
    return (key * (w_norm.float() * w_qk.float())).sum(-1)


def mix_sources(sources: list, logits: torch.Tensor, mix_rounding: int = 0) -> torch.Tensor:
    """The mixed row, sum_s softmax_s(logits) * src_s in fp32, rounded to the sources' dtype (kept in fp32
    with MIX_SUM_FP32)."""
    dt = torch.float32 if mix_rounding & MIX_SUM_FP32 else sources[0].dtype
    if mix_rounding & MIX_DIV:
        mx = logits.amax(0)
        num = den = None
        for lg, s in zip(logits.unbind(0), sources):
            e = torch.exp(lg - mx)
            t = e.unsqueeze(-1) * s.float()
            num = t if num is None else num + t
            den = e if den is None else den + e
        return (num / den.unsqueeze(-1)).to(dt)
    p = torch.softmax(logits, dim=0)
    return (p.unsqueeze(-1) * torch.stack(sources, dim=0).float()).sum(0).to(dt)


def attnres_mix_as(prefix, delta, blocks, w_norm, w_qk, g, eps, rounding: int = 0, mix_rounding: int = 0):
    """(normed, updated): model.functional.attnres_mix with the output norm's rounding order
    `rounding` and the mixer's `mix_rounding` (module comment above); (0, 0) is attnres_mix itself."""
    updated = prefix if delta is None else prefix + delta
    if blocks:
        sources = [*blocks, updated]
        mixed = mix_sources(sources, mix_logits(torch.stack(sources, dim=0), w_norm, w_qk, eps, mix_rounding),
                            mix_rounding)
    else:
        mixed = updated
    if mixed.dtype != updated.dtype:   # MIX_SUM_FP32: normalised in fp32, rounded once to the model dtype
        return rms_norm_as(mixed, g, eps, rounding, round_out=False).to(updated.dtype), updated
    return rms_norm_as(mixed, g, eps, rounding), updated


def all_reduce(x: torch.Tensor, group: str | None) -> torch.Tensor:
    if not group:
        return x
    out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group)
    return torch.ops._c10d_functional.wait_tensor(out)


def all_gather(x: torch.Tensor, group: str | None, tp: int) -> torch.Tensor:
    """[M, n] on each rank -> [tp, M, n] (rank-major)."""
    if not group:
        return x.unsqueeze(0)
    out = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), tp, group)
    return torch.ops._c10d_functional.wait_tensor(out).view(tp, *x.shape)


def oproj_allreduce_residual(x, w, residual, blocks, w_norm, w_qk, g, eps, group, rounding=0, mix_rounding=0):
    """updated = residual + all_reduce(x @ w.T); normed = AttnRes/RMSNorm(updated) (or empty), rounded
    as `rounding` / `mix_rounding` say."""
    if g is None:
        updated = residual + all_reduce(F.linear(x, w), group)
        return updated, updated.new_empty(0)
    return residual_norm(F.linear(x, w), residual, blocks, w_norm, w_qk, g, eps, group, rounding, mix_rounding)


def residual_norm(delta, residual, blocks, w_norm, w_qk, g, eps, group, rounding=0, mix_rounding=0):
    """updated = residual + all_reduce(delta); normed = AttnRes/RMSNorm(updated), rounded as
    `rounding` (the output norm) and `mix_rounding` (the mixer) say."""
    normed, updated = attnres_mix_as(residual, all_reduce(delta, group), list(blocks), w_norm, w_qk, g, eps,
                                     rounding, mix_rounding)
    return updated, normed


def moe_latent_tail(y, topk_w, shared_partial, g_latent, w_up, eps, rank, group, rounding=0):
    """Finalize (weighted top-k sum) + latent all-reduce + RMSNorm (rounded as `rounding` says) +
    up-projection shard + add into this rank's column slice of the shared-expert partial."""
    routed = (y.float() * topk_w.unsqueeze(-1)).sum(1).to(y.dtype)
    routed = all_reduce(routed, group)
    tail = F.linear(rms_norm_as(routed, g_latent, eps, rounding), w_up)
    n = tail.shape[-1]
    if n == shared_partial.shape[-1]:
        return shared_partial + tail
    out = shared_partial.clone()
    out[:, rank * n:(rank + 1) * n] += tail
    return out


def router_latent_sharded(x, w_router, w_down, rank, tp, group, router_fp32=False):
    """Rows [rank*s, (rank+1)*s) of [W_r; W_down] times x on each rank, all-gathered.

    Returns (router logits [M, E], latent [M, L]) equal to the replicated GEMMs: the logits in x.dtype,
    or with router_fp32 as x.float() @ W_r.float().T (then the gather carries fp32; the latent's
    round trip through fp32 is exact)."""
    router = (lambda w: F.linear(x.float(), w.float())) if router_fp32 else (lambda w: F.linear(x, w))
    if tp == 1:
        return router(w_router), F.linear(x, w_down)
    E, n = w_router.shape[0], w_router.shape[0] + w_down.shape[0]
    s = n // tp
    a, b = rank * s, (rank + 1) * s
    pieces = []
    if a < E:  # this rank's rows of W_r
        pieces.append(router(w_router[a:min(b, E)]))
    if b > E:  # this rank's rows of W_down
        pieces.append(F.linear(x, w_down[max(a, E) - E:b - E]))
    part = torch.cat([t.to(pieces[0].dtype) for t in pieces], -1) if len(pieces) > 1 else pieces[0]
    if router_fp32:
        part = part.float()
    full = all_gather(part, group, tp)  # [tp, M, s]
    full = full.permute(1, 0, 2).reshape(x.shape[0], n)
    return full[:, :E].clone(), full[:, E:].to(x.dtype)  # fresh tensors: outputs may not alias


def router_topk(logits, bias, k, scale, ids_int32=False):
    """The K3 router's selection (K3-SPEC: sigmoid scores of the fp32 logits, top-k by score +
    correction bias, weights = the selected scores renormalised to sum 1, times the scale); the ids
    as int32 with ids_int32."""
    scores = torch.sigmoid(logits.float())
    _, ids = torch.topk(scores + bias, k, dim=-1)
    w = scores.gather(-1, ids)
    return ids.to(torch.int32) if ids_int32 else ids, w / w.sum(-1, keepdim=True) * scale


def kda_conv_decode(xq, xk, xv, state, w):
    """The KDA short convolution at decode (one new token), the model's math (layers.KDA.forward):
    the window [state | x] per channel of x = [xq | xk | xv], out = SiLU(sum_t window_t * w_t)
    (products in the model dtype, as the model's bf16 `cols * w`), split back into q, k, v
    (contiguous [M, C / 3] each); new_state = the window's last KW - 1 inputs. The state is not
    changed here (the caller writes new_state back)."""
    M, cq = xq.shape
    kw = w.shape[-1]
    qkv = torch.cat([xq, xk, xv], -1).view(M, 1, -1).transpose(1, 2)  # [M, C, 1]
    window = torch.cat([state, qkv], dim=-1)                          # [M, C, KW]
    y = F.silu((window.unfold(-1, kw, 1) * w.unsqueeze(1)).sum(-1)).transpose(1, 2).reshape(M, -1)
    q, k, v = (t.clone(memory_format=torch.contiguous_format) for t in y.split(cq, dim=-1))
    return q, k, v, window[..., 1:].clone(memory_format=torch.contiguous_format)


def kda_conv_decode_(xq, xk, xv, state, w):
    """k3::kda_conv_decode_: kda_conv_decode with new_state written into `state`; (q, k, v)."""
    q, k, v, new_state = kda_conv_decode(xq, xk, xv, state, w)
    state.copy_(new_state)
    return q, k, v


def kda_decode_gated(q, k, v, f, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    """The KDA decode step from its raw inputs (patterns.kda): q, k L2-normalised per head (x /
    clamp_min(||x||, eps)), q scaled, both cast to qk_dtype; decay = lower * sigmoid(exp(A_log) *
    (f + dt_bias)); beta = sigmoid(beta); then the model's k3model::kda_decode (mutates state)."""
    def l2(x):
        x = x.float()
        return x / x.pow(2).sum(-1, keepdim=True).pow(0.5).clamp_min(eps)
    H, K = f.shape[-2], f.shape[-1]
    qn = (l2(q) * scale).to(qk_dtype)
    kn = l2(k).to(qk_dtype)
    g = lower * torch.sigmoid(torch.exp(a_log.float()).view(1, H, 1) * (f.float() + dt_bias.float().view(1, H, K)))
    b = torch.sigmoid(beta.float())
    return torch.ops.k3model.kda_decode(qn, kn, v, g, b, state)


def kda_decode_fb(q, k, v, fa, f_b, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    """k3::kda_decode_fb: the gate input f = fa @ f_b.T ([M, R] by [H * K, R], in the model dtype as
    F.linear returns it) viewed as [M, H, K], then k3::kda_decode_gated (mutates state)."""
    f = torch.mm(fa, f_b.t()).view(q.shape)
    return kda_decode_gated(q, k, v, f, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype)


def kda_step_decode_(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state, lower, scale, eps, qk_dtype,
                     o_norm=None, gate=None, o_eps=0.0):
    """k3::kda_step_decode_: kda_conv_decode_ (the conv state shifted in place), then kda_decode_fb on its
    q, k, v as [M, H, K] / [M, H, V] (mutates state); returns o [M, H, V], or with o_norm (fold_kda_onorm)
    the model's output norm of it: rms_norm(o, o_norm, o_eps) * sigmoid(gate viewed [M, H, V])."""
    M, H = xq.shape[0], a_log.shape[0]
    q, k, v = kda_conv_decode_(xq, xk, xv, conv_state, w)
    o = kda_decode_fb(q.view(M, H, -1), k.view(M, H, -1), v.view(M, H, -1), fa, f_b, beta, a_log, dt_bias, state,
                      lower, scale, eps, qk_dtype)
    if o_norm is None:
        return o
    return rms_norm(o, o_norm, o_eps) * torch.sigmoid(gate.reshape(o.shape))


def shared_expert_split(x, w_gate, w_down, beta, linear_beta, w_up=None):
    """k3::shared_expert_async's math: the SiTU MLP over [gate; up] (one weight, or two with w_up)."""
    if w_up is None:
        return shared_expert(x, w_gate, w_down, beta, linear_beta)
    gu = torch.cat([F.linear(x, w_gate), F.linear(x, w_up)], -1)
    return F.linear(situ(gu, beta, linear_beta), w_down)


def mla_decode_normed(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, rounding=0):
    """k3::mla_decode_normed: kv_new = cat([rms_norm(kv_a[:, :L], kv_norm_w, eps), kv_a[:, L:]]) (the
    model's MLA prologue; the norm in the rounding order `rounding`), then the model's
    k3model::mla_decode (mutates kv_cache)."""
    L = q_lat.shape[-1]
    kv_new = torch.cat([rms_norm_as(kv_a[:, :L], kv_norm_w, eps, rounding), kv_a[:, L:]], -1)
    return torch.ops.k3model.mla_decode(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale)


def mla_decode_uv(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, w_uv, w_nk, gate=None, rounding=0):
    """k3::mla_decode_uv: mla_decode_normed's o [M, H, L], then decode_bmm(o as [H, M, L], w_uv, w_nk,
    gate): the value up-projection (times the sigmoid output gate), [H, M, V] stored token-major."""
    o = mla_decode_normed(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, rounding)
    return decode_bmm(o.permute(1, 0, 2), w_uv, w_nk, gate)


def decode_bmm(x, w, w_nk, gate=None):
    """k3::decode_bmm: torch.bmm(x, w or w^T) (* sigmoid(gate) transposed to [H, M, N]), the result
    stored token-major (the op's layout contract: a permuted view of a contiguous [M, H, N])."""
    y = torch.bmm(x, w.transpose(1, 2) if w_nk else w).permute(1, 0, 2)
    if gate is not None:
        y = y * torch.sigmoid(gate)
    out = y.new_empty(y.shape)  # exactly the fake's strides (contiguous() keeps a size-1 dim's stride)
    out.copy_(y)
    return out.permute(1, 0, 2)
