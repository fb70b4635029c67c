"""Attention: the launchers of the KDA and MLA decode kernels (kernels/triton_kda.py, triton_conv.py,
triton_mla.py, and fla-core's fused_recurrent_kda), and their `k3::` registrations. The model's own
`k3model::mla_decode` gets the same MLA kernels through `model_ops` (registered at `import k3compile`).

- kda_conv_decode (and kda_conv_decode_, in place): one Triton kernel (kernels/triton_conv.py): the KDA
  short conv + SiLU of one token.
- kda_decode_gated: one fla-core fused_recurrent_kda kernel with the q/k L2 norms, the gate and
  beta's sigmoid in the kernel and the state updated in place (where fla-core imports).
- kda_decode_fb: one Triton kernel (kernels/triton_kda.py): the gate's f_b GEMV, the norms, the gate
  and the recurrence, per (token, head, block of value columns); the state updated in place.
- kda_step_decode_: one Triton kernel (kernels/triton_kda.py): kda_decode_fb's with the short conv of
  the head's q, k, v channels in front, both states updated in place; optional output norm + gate.
- mla_decode_normed: the Triton MLA decode (kernels/triton_mla.py) with the kv_a RMSNorm in its
  split kernel, where `mla_decode_fits` takes the shapes (and K3_KNOBS mla_triton is not 0).
- mla_decode_uv: the same split kernel, then one kernel combining the splits and applying the
  value up-projection (and the sigmoid output gate) per (token, head, value block).
"""
from __future__ import annotations

import torch
import triton

from ..config import knob, knob_flag
from ..model import attention_ops as A
from . import gemm, triton_conv, triton_kda, triton_mla, tuning
from ..rounding import NORM_CAST_FIRST, NORM_IN_DTYPE
from .common import TL
from .registry import register

def mla_decode_fits(q_lat, q_rope, kv_new, kv_cache) -> bool:
    """Shapes the Triton MLA decode takes: [M, H, L] / [M, H, R] queries, an [M, S, L + R] cache with
    unit stride along its last dim, L and R powers of two >= 16, float dtypes."""
    if q_lat.dim() != 3 or q_rope.dim() != 3 or kv_cache.dim() != 3 or kv_new.dim() != 2:
        return False
    L, R = q_lat.shape[-1], q_rope.shape[-1]
    pow2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    return (pow2(L) and pow2(R) and kv_cache.shape[-1] == L + R and kv_cache.stride(-1) == 1
            and q_lat.stride(-1) == 1 and q_rope.stride(-1) == 1
            and kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and q_lat.dtype in (torch.bfloat16, torch.float16, torch.float32))


def mla_decode(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale, kv_norm=None, uv=None) -> torch.Tensor:
    """k3model::mla_decode (one new token per row) by triton_mla: kv_cache[m, seq_lens[m]] = kv_new[m]
    (inside the split kernel), then attention of the M x H queries over positions 0..seq_lens[m] of
    their row; o [M, H, L] in q_lat's dtype. The caller validated the shapes
    (attention_ops.validate_mla) and mla_decode_fits. kv_norm=(w [L], eps): kv_new is the raw kv_a
    row, its first L columns RMS-normalised in the split kernel (k3::mla_decode_normed; NORM_CAST_FIRST
    followed, the rsqrt / div / reciprocal spellings alike in its fp32 math, NORM_IN_DTYPE declined by
    the registration). uv=(W, w_nk,
    gate): the result is k3::decode_bmm(o.permute(1, 0, 2), W, w_nk, gate) instead of o ([H, M, V],
    stored token-major), the combine and the value up-projection in one kernel (k3::mla_decode_uv)."""
    M, H, L = q_lat.shape
    R, S = q_rope.shape[-1], kv_cache.shape[1]
    if uv is not None:
        w, w_nk, gate = uv
        V = w.shape[1] if w_nk else w.shape[2]
        out = torch.empty(M, H, V, dtype=q_lat.dtype, device=q_lat.device)
    else:
        out = torch.empty(M, H, L, dtype=q_lat.dtype, device=q_lat.device)
    if M == 0:
        return out.permute(1, 0, 2) if uv is not None else out
    lens = seq_lens.to(device=kv_cache.device, dtype=torch.long)
    hb = triton.cdiv(H, tuning.MLA_BH)
    # splits of the cache capacity (the lengths are not known on the host under a CUDA graph):
    # about MLA_PROGRAMS programs, each at least one tile; a split past its row's length exits at once
    per_split = triton.cdiv(S, max(1, tuning.MLA_PROGRAMS // (M * hb)))
    ch = max(tuning.MLA_MIN_CH, tuning.MLA_BS, triton.next_power_of_2(per_split))
    ns = triton.cdiv(S, ch)
    part_o = torch.empty(M, H, ns, L, dtype=torch.float32, device=q_lat.device)
    part_ml = torch.empty(M, H, ns, 2, dtype=torch.float32, device=q_lat.device)
    if kv_new.stride(-1) != 1:
        kv_new = kv_new.contiguous()
    triton_mla.mla_split_kernel[(M, hb, ns)](
        q_lat, q_rope, kv_new, kv_cache, lens, part_o, part_ml, H, S, ch, ns, float(scale),
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_new.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        kv_norm[0] if kv_norm else kv_new, float(kv_norm[1]) if kv_norm else 0.0,
        L=L, R=R, BH=tuning.MLA_BH, BS=tuning.MLA_BS, IEEE=kv_cache.dtype == torch.float32,
        NORM=kv_norm is not None, NORM_CF=bool(kv_norm and len(kv_norm) > 2 and kv_norm[2] & NORM_CAST_FIRST),
        num_warps=tuning.MLA_WARPS)
    if uv is not None:
        swl, swv = (w.stride(2), w.stride(1)) if w_nk else (w.stride(1), w.stride(2))
        g = gate if gate is not None else out
        bv = int(knob("mla_uv_bv") or tuning.MLA_UV_BV)
        flat = knob_flag("mla_uv_flat", tuning.MLA_UV_FLAT and M <= tuning.MLA_UV_FLAT_MAX_M)
        triton_mla.mla_combine_uv_kernel[(M, H, triton.cdiv(V, bv))](
            part_o, part_ml, w, g, out, H, ns, V, w.stride(0), swl, swv, g.stride(0), g.stride(1), g.stride(2),
            L=L, BNS=min(8, triton.next_power_of_2(ns)), BV=bv, GATE=gate is not None,
            NSC=ns if flat else 0, NSP=triton.next_power_of_2(ns) if flat else 1,
            num_warps=int(knob("mla_uv_warps") or tuning.MLA_UV_WARPS))
        return out.permute(1, 0, 2)
    flag = knob("mla_combine_bl")
    bl = int(flag) if flag else (tuning.MLA_COMBINE_BL if M * H < tuning.MLA_PROGRAMS else 0)
    bl = bl if bl and bl & (bl - 1) == 0 and L % bl == 0 else 0
    triton_mla.mla_combine_kernel[(M, H, L // bl if bl else 1)](
        part_o, part_ml, out, H, ns, out.stride(0), out.stride(1), L=L,
        BNS=min(16, triton.next_power_of_2(ns)), BL=bl, num_warps=4)
    return out


def kda_conv_decode_fits(xq, xk, xv, state, w) -> bool:
    """Calls the Triton short conv takes: 2-D [M, C/3] inputs of one float dtype with unit stride
    along channels, state [M, C, KW - 1] and w [C, KW] (contiguous), 2 <= KW <= 8."""
    if xq.dim() != 2 or state.dim() != 3 or w.dim() != 2:
        return False
    M, cq = xq.shape
    C, kw = w.shape
    return (xk.shape == xq.shape == xv.shape and C == 3 * cq and 2 <= kw <= 8
            and tuple(state.shape) == (M, C, kw - 1) and w.is_contiguous()
            and all(t.stride(-1) == 1 for t in (xq, xk, xv))
            and xq.dtype in TL and xk.dtype == xq.dtype == xv.dtype == state.dtype == w.dtype)


def kda_conv_decode(xq, xk, xv, state, w, inplace: bool = False):
    """k3::kda_conv_decode by triton_conv (the caller checked kda_conv_decode_fits): (q, k, v,
    new_state); inplace (k3::kda_conv_decode_): the new state is written into `state` (returned)."""
    M, cq = xq.shape
    kw = w.shape[1]
    q, k, v = (torch.empty(M, cq, dtype=xq.dtype, device=xq.device) for _ in range(3))
    new_state = state if inplace else torch.empty(state.shape, dtype=state.dtype, device=state.device)
    BLOCK = int(knob("conv_block") or tuning.CONV_BLOCK)
    if M:
        triton_conv.kda_conv_decode_kernel[(M, triton.cdiv(3 * cq, BLOCK))](
            xq, xk, xv, state, w, q, k, v, new_state, cq, xq.stride(0), xk.stride(0), xv.stride(0),
            state.stride(0), state.stride(1), state.stride(2), *new_state.stride(), KW=kw, BLOCK=BLOCK,
            num_warps=max(1, min(4, BLOCK // 32)))
    return q, k, v, new_state


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _kda_fb_rest_fits(M, H, K, V, dtype, fa, f_b, beta, a_log, dt_bias, state) -> bool:
    """The checks of kda_decode_fb_fits past q, k, v (of shapes [M, H, K] / [M, H, V] and dtype `dtype`)."""
    R = fa.shape[-1] if fa.dim() == 2 else -1
    return (M > 0 and _pow2(K) and _pow2(V) and 16 <= K <= 256 and 16 <= V <= 256
            and V % min(tuning.KDA_FB_BV, V) == 0 and R > 0 and R % 8 == 0 and fa.shape[0] == M and fa.stride(1) == 1 and f_b.dim() == 2
            and tuple(f_b.shape) == (H * K, R) and f_b.is_contiguous() and dtype in TL and fa.dtype == f_b.dtype == dtype
            and beta.dim() == 2 and tuple(beta.shape) == (M, H) and beta.stride(1) == 1 and beta.dtype in TL
            and tuple(a_log.shape) == (H,) and a_log.is_contiguous() and dt_bias.numel() == H * K
            and dt_bias.is_contiguous() and tuple(state.shape) == (M, H, K, V) and state.dtype == torch.float32
            and state.is_contiguous() and len({t.device for t in (fa, f_b, beta, a_log, dt_bias, state)}) == 1)


def kda_decode_fb_fits(q, k, v, fa, f_b, beta, a_log, dt_bias, state) -> bool:
    """Calls triton_kda takes: q, k [M, H, K] and v [M, H, V] with unit strides inside a row, K and V
    powers of two in [16, 256], fa [M, R] (R a multiple of 8) with unit stride along R, f_b [H * K, R]
    contiguous, all of one float dtype; beta [M, H] with unit stride along H; A_log [H] and dt_bias
    [H * K] contiguous; the state [M, H, K, V] fp32 contiguous."""
    if q.dim() != 3 or v.dim() != 3:
        return False
    M, H, K = q.shape
    V = v.shape[-1]
    return (tuple(k.shape) == (M, H, K) and tuple(v.shape[:2]) == (M, H)
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v))
            and k.dtype == v.dtype == q.dtype and q.device == k.device == v.device == state.device
            and _kda_fb_rest_fits(M, H, K, V, q.dtype, fa, f_b, beta, a_log, dt_bias, state))


def kda_decode_fb(q, k, v, fa, f_b, beta, a_log, dt_bias, state, lower: float, scale: float, eps: float,
                  qk_dtype) -> torch.Tensor:
    """k3::kda_decode_fb by triton_kda (the caller checked kda_decode_fb_fits): o [M, H, V] in v's
    dtype; the state updated in place."""
    M, H, K = q.shape
    V, R = v.shape[-1], fa.shape[-1]
    o = torch.empty(M, H, V, dtype=v.dtype, device=v.device)
    bv = min(int(knob("kda_fb_bv") or tuning.KDA_FB_BV), V)
    triton_kda.kda_decode_fb_kernel[(M * H * (V // bv),)](
        q, k, v, fa, f_b, beta, a_log, dt_bias, state, o, H, q.stride(0), k.stride(0), v.stride(0), fa.stride(0),
        beta.stride(0), float(lower), float(scale), float(eps), K=K, V=V, R=R, BV=bv, BR=min(32, R & -R),
        QK_DT=TL[qk_dtype], F_DT=TL[fa.dtype], num_warps=4)
    return o


def kda_step_decode_fits(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state) -> bool:
    """Calls triton_kda's step kernel takes: the conv op's (kda_conv_decode_fits) with width 4 and the
    value head width equal to the key's (one conv over [q | k | v] channels of H heads each), and
    kda_decode_fb_fits on the conv's outputs viewed [M, H, K]."""
    if xq.dim() != 2 or a_log.dim() != 1 or not kda_conv_decode_fits(xq, xk, xv, conv_state, w) or w.shape[1] != 4:
        return False
    M, H = xq.shape[0], a_log.shape[0]
    if H == 0 or xq.shape[1] % H:
        return False
    K = xq.shape[1] // H   # the conv's outputs viewed [M, H, K], V = K
    return (w.dtype == xq.dtype and conv_state.is_contiguous() and xq.device == state.device
            and _kda_fb_rest_fits(M, H, K, K, xq.dtype, fa, f_b, beta, a_log, dt_bias, state))


def kda_onorm_fits(xq, xv, a_log, o_norm, gate) -> bool:
    """The output norm kda_step_decode_kernel takes (NORM): a [V] weight and a gate [M, H * V] with unit
    stride along it, both in the model dtype, V a power of two (one head's row in registers)."""
    M, H = xq.shape[0], a_log.shape[0]
    V = xq.shape[1] // H
    return (gate is not None and o_norm.dim() == 1 and o_norm.shape[0] == V and o_norm.is_contiguous()
            and gate.dim() == 2 and tuple(gate.shape) == (M, H * V) and gate.stride(1) == 1
            and o_norm.dtype == gate.dtype == xv.dtype and V & (V - 1) == 0
            and o_norm.device == gate.device == xq.device)


def kda_step_decode(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state, lower: float, scale: float,
                    eps: float, qk_dtype, o_norm=None, gate=None, o_eps: float = 0.0) -> torch.Tensor:
    """k3::kda_step_decode_ by triton_kda (the caller checked kda_step_decode_fits, and kda_onorm_fits
    with o_norm): o [M, H, V] (with o_norm: normed and gated); the conv state and the state updated in
    place."""
    M, H = xq.shape[0], a_log.shape[0]
    K = V = xq.shape[1] // H
    R = fa.shape[-1]
    o = torch.empty(M, H, V, dtype=xv.dtype, device=xv.device)
    bv = min(int(knob("kda_fb_bv") or tuning.KDA_FB_BV), V)
    p = max(1, min(int(knob("kda_step_p") or tuning.KDA_STEP_P), V // bv))
    while (V // bv) % p:
        p -= 1
    cnt = gemm.split_counters(xq.device) if p > 1 and M * H <= gemm.SPLIT_SLOTS else None
    if cnt is None:   # no counters for this call: one program per (token, head)
        p, cnt = 1, o
    norm = o_norm is not None
    triton_kda.kda_step_decode_kernel[(M * H * p,)](
        xq, xk, xv, conv_state, w, fa, f_b, beta, a_log, dt_bias, state, o, cnt, H, xq.stride(0), xk.stride(0),
        xv.stride(0), *conv_state.stride(), fa.stride(0), beta.stride(0), float(lower), float(scale), float(eps),
        o_norm if norm else o, gate if norm else o, gate.stride(0) if norm else 0, float(o_eps),
        K=K, V=V, R=R, BV=bv, P=p, BR=min(32, R & -R), QK_DT=TL[qk_dtype], F_DT=TL[fa.dtype], NORM=norm,
        num_warps=4)
    return o


def kda_decode_gated_fla(q, k, v, f, beta, a_log, dt_bias, state, lower: float, scale: float) -> torch.Tensor:
    """k3::kda_decode_gated as one fla-core ``fused_recurrent_kda`` kernel (T = 1): q and k
    L2-normalised in the kernel (x / sqrt(sum(x^2) + 1e-6)), q scaled, the decay lower *
    sigmoid(exp(A_log) * (f + dt_bias)) and beta's sigmoid in the kernel; the K-major fp32 state
    updated in place, the output written into an empty buffer (attention_ops.fla_decode_in_place).
    The caller checked `attention_ops.fla_fused_recurrent_kda_fwd()` and a contiguous fp32 state."""
    args = tuple(x.unsqueeze(1) for x in (*A.fla_qkv(q, k, v), f.contiguous(), beta.contiguous()))  # T = 1
    kw = dict(A_log=a_log.float().contiguous(), dt_bias=dt_bias.float().contiguous().view(-1), scale=float(scale),
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=float(lower))
    return A.fla_decode_in_place(args, kw, state, v.dtype)


# ------------------------------------------------------------------ registrations
def _mla_triton() -> bool:
    """The Triton MLA decode kernels serve the k3 MLA ops unless K3_KNOBS=mla_triton=0 (which leaves the
    model's op on its reference too: model_ops)."""
    return knob("mla_triton", "1") != "0"


def _ok_kda_gated(q, k, v, f, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    # fla's in-kernel L2 norm adds 1e-6 under the square root: the same as clamping at eps <= 1e-6
    # for any vector whose norm is not tiny
    return (A.fla_fused_recurrent_kda() is not None and A.fla_fused_recurrent_kda_fwd() is not None
            and q.dim() == 3 and q.shape[0] > 0 and q.shape[-1] <= 256 and state.dtype == torch.float32
            and state.is_contiguous() and eps <= 1e-6)


@register("kda_decode_gated", "cuda", "fla_fused_recurrent_kda", _ok_kda_gated)
def _kda_gated(q, k, v, f, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    return kda_decode_gated_fla(q, k, v, f, beta, a_log, dt_bias, state, lower, scale)


def _ok_kda_fb(q, k, v, fa, f_b, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    return qk_dtype in TL and kda_decode_fb_fits(q, k, v, fa, f_b, beta, a_log, dt_bias, state)


@register("kda_decode_fb", "cuda", "triton_kda_fb", _ok_kda_fb)
def _kda_fb(q, k, v, fa, f_b, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    return kda_decode_fb(q, k, v, fa, f_b, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype)


def _ok_kda_step(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state, lower, scale, eps, qk_dtype,
                 o_norm=None, gate=None, o_eps=0.0):
    return (qk_dtype in TL and kda_step_decode_fits(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state)
            and (o_norm is None or kda_onorm_fits(xq, xv, a_log, o_norm, gate)))


@register("kda_step_decode_", "cuda", "triton_kda_step", _ok_kda_step)
def _kda_step(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state, lower, scale, eps, qk_dtype,
              o_norm=None, gate=None, o_eps=0.0):
    return kda_step_decode(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state, lower, scale, eps,
                           qk_dtype, o_norm, gate, o_eps)


def _ok_mla_normed(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, rounding=0):
    L = q_lat.shape[-1] if q_lat.dim() == 3 else -1
    return (_mla_triton() and not rounding & NORM_IN_DTYPE and mla_decode_fits(q_lat, q_rope, kv_a, kv_cache)
            and kv_norm_w.shape == (L,) and kv_norm_w.is_floating_point() and kv_norm_w.device == kv_a.device)


@register("mla_decode_normed", "cuda", "triton_mla", _ok_mla_normed)
def _mla_normed(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, rounding=0):
    A.validate_mla(q_lat, q_rope, kv_a, kv_cache, seq_lens, scale, prefill=False)
    A.mla_check_lengths(seq_lens, 1, kv_cache.shape[1])   # data checks (skipped in a graph capture)
    return mla_decode(q_lat, q_rope, kv_a, kv_cache, seq_lens, scale, kv_norm=(kv_norm_w, eps, rounding))


def _ok_mla_uv(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, w_uv, w_nk, gate=None, rounding=0):
    if not _ok_mla_normed(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, rounding) or w_uv.dim() != 3:
        return False
    M, H, L = q_lat.shape
    V = w_uv.shape[1] if w_nk else w_uv.shape[2]
    return (w_uv.shape[0] == H and (w_uv.shape[2] if w_nk else w_uv.shape[1]) == L and w_uv.dtype == q_lat.dtype
            and (gate is None or (tuple(gate.shape) == (M, H, V) and gate.dtype == q_lat.dtype)))


@register("mla_decode_uv", "cuda", "triton_mla_uv", _ok_mla_uv)
def _mla_uv(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, w_uv, w_nk, gate=None, rounding=0):
    A.validate_mla(q_lat, q_rope, kv_a, kv_cache, seq_lens, scale, prefill=False)
    A.mla_check_lengths(seq_lens, 1, kv_cache.shape[1])   # data checks (skipped in a graph capture)
    return mla_decode(q_lat, q_rope, kv_a, kv_cache, seq_lens, scale, kv_norm=(kv_norm_w, eps, rounding),
                      uv=(w_uv, w_nk, gate))


def _ok_conv(xq, xk, xv, state, w):
    return kda_conv_decode_fits(xq, xk, xv, state, w)


@register("kda_conv_decode", "cuda", "triton_short_conv", _ok_conv)
def _kda_conv(xq, xk, xv, state, w):
    return kda_conv_decode(xq, xk, xv, state, w)


@register("kda_conv_decode_", "cuda", "triton_short_conv", _ok_conv)
def _kda_conv_inplace(xq, xk, xv, state, w):
    return kda_conv_decode(xq, xk, xv, state, w, inplace=True)[:3]
