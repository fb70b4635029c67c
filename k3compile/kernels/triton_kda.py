"""Triton kernels for the KDA decode step: `k3::kda_decode_fb` and `k3::kda_step_decode_`.

kda_decode_fb_kernel: one program per (token, head, block of BV value columns), as fla-core's
fused_recurrent_kda (BV = 32, 4 warps): a head of K = V = 128 at M = 1 is 4 programs. Each program
- computes its head's gate input f = fa @ f_b[head rows].T (K outputs over the rank R, fp32 sums,
  rounded to the model dtype as F.linear's output), which cuBLAS's GEMV did before in its own launch:
  the K x R weight slice is read by each of the head's V / BV programs (from L2 after the first);
- the decay g = lower * sigmoid(exp(A_log) * (f + dt_bias)), beta = sigmoid(b);
- q, k L2-normalised (x / max(||x||, eps)), q scaled, both rounded to qk_dtype, as the model does;
- the recurrence on its [K, BV] fp32 state tile: S *= exp(g); u = beta * (v - k S); S += k u^T;
  o = q S; o stored in the model dtype and S written back in place.
No two programs touch the same state element. Inside a program every thread's store of S comes
after the block-wide reduction k S, which needs every thread's loads: an element held by two
threads (replicated layouts) is read by both before either writes it.

kda_step_decode_kernel: the same, with the short convolution (width 4) of the head's q, k and v
channels in front (fold_kda_conv's k3::kda_conv_decode_ math: products rounded to the model dtype,
fp32 sum, rounded, SiLU), the conv state shifted in place. P programs per (token, head), each
taking V / (BV * P) value blocks in turn. Every program of a head computes the head's q and k
from the conv state, so the shift of those channels must wait until all P have read them: each
program, after a CTA barrier (its threads' window loads done), counts in on cnt[token, head] with a
gpu-scope acq_rel atomic; the one that arrives last shifts the q / k state and puts the counter
back to 0 (mma_gemm_kernel's split-K protocol; no program waits for another, so no co-residency is
assumed). Its v channels belong to one program, which shifts them after the same barrier. With
P == 1 no counter is used.
NORM (fold_kda_onorm's output norm): the program that arrives last (P == 1: the head's one program,
after a CTA barrier) reads the head's V outputs back (stored by every program before its count, read
past L1) and overwrites them with the model's rms_norm(o, w_o, o_eps) * sigmoid(gate), rounded where
the model rounds (the normed row, the sigmoid, the product).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gate_qkb(fa, fb, beta, a_log, dt_bias, xq, xk, m, h, sfa, sb, lower, scale, eps, ok,
              K: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, QK_DT: tl.constexpr, F_DT: tl.constexpr):
    """(decay g [K], q normed and scaled, k normed, both rounded to QK_DT, beta) of head h of token m,
    from its raw q, k (fp32 [K]) and the gate's up-projection f = fa[m] @ fb[h * K:(h + 1) * K].T."""
    acc = tl.zeros([K], tl.float32)
    for r0 in tl.static_range(0, R, BR):
        orr = r0 + tl.arange(0, BR)
        w = tl.load(fb + (h * K + ok)[:, None] * R + orr[None, :]).to(tl.float32)
        x = tl.load(fa + m * sfa + orr).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    f = acc.to(F_DT).to(tl.float32)
    g = lower * tl.sigmoid(tl.exp(tl.load(a_log + h).to(tl.float32))
                           * (f + tl.load(dt_bias + h * K + ok).to(tl.float32)))
    qn = (xq / tl.maximum(tl.sqrt(tl.sum(xq * xq, 0)), eps) * scale).to(QK_DT).to(tl.float32)
    kn = (xk / tl.maximum(tl.sqrt(tl.sum(xk * xk, 0)), eps)).to(QK_DT).to(tl.float32)
    b = tl.sigmoid(tl.load(beta + m * sb + h).to(tl.float32))
    return g, qn, kn, b


@triton.jit
def _recur(S, ps, po, g, qn, kn, b, vb):
    """One step on a [K, BV] state tile S (loaded from ps): S *= exp(g); u = b (v - k S); S += k u^T;
    o = q S stored at po (its dtype), S stored back at ps."""
    S = S * tl.exp(g)[:, None]
    u = b * (vb - tl.sum(S * kn[:, None], 0))
    S = S + kn[:, None] * u[None, :]
    tl.store(po, tl.sum(S * qn[:, None], 0).to(po.dtype.element_ty))
    tl.store(ps, S)


@triton.jit
def kda_decode_fb_kernel(q, k, v, fa, fb, beta, a_log, dt_bias, state, o, H, sq, sk, sv, sfa, sb,
                         lower, scale, eps, K: tl.constexpr, V: tl.constexpr, R: tl.constexpr,
                         BV: tl.constexpr, BR: tl.constexpr, QK_DT: tl.constexpr, F_DT: tl.constexpr):
    pid = tl.program_id(0)
    NV: tl.constexpr = V // BV
    i_v = pid % NV
    h = (pid // NV) % H
    m = (pid // NV // H).to(tl.int64)
    ok = tl.arange(0, K)
    ov = i_v * BV + tl.arange(0, BV)
    # the state tile first: its load has the longest way to come and depends on nothing
    ps = state + ((m * H + h) * K + ok[:, None]) * V + ov[None, :]
    S = tl.load(ps)
    xq = tl.load(q + m * sq + h * K + ok).to(tl.float32)
    xk = tl.load(k + m * sk + h * K + ok).to(tl.float32)
    g, qn, kn, b = _gate_qkb(fa, fb, beta, a_log, dt_bias, xq, xk, m, h, sfa, sb, lower, scale, eps, ok, K, R, BR,
                             QK_DT, F_DT)
    vb = tl.load(v + m * sv + h * V + ov).to(tl.float32)
    _recur(S, ps, o + (m * H + h) * V + ov, g, qn, kn, b, vb)


@triton.jit
def _conv4(cs, sct, cw, c, x, DT: tl.constexpr):
    """Width-4 causal conv + SiLU of channels c (the window: state positions 0..2 at cs + t * sct, then
    x), as kernels/triton_conv.py: products rounded to DT, fp32 sum in window order, rounded, SiLU in
    fp32, rounded. Returns (y in DT, state positions 1 and 2 as loaded: the shifted window's first two)."""
    s0 = tl.load(cs)
    s1 = tl.load(cs + sct)
    s2 = tl.load(cs + 2 * sct)
    wp = cw + c * 4
    acc = tl.zeros(c.shape, tl.float32)
    acc += (s0.to(tl.float32) * tl.load(wp).to(tl.float32)).to(DT).to(tl.float32)
    acc += (s1.to(tl.float32) * tl.load(wp + 1).to(tl.float32)).to(DT).to(tl.float32)
    acc += (s2.to(tl.float32) * tl.load(wp + 2).to(tl.float32)).to(DT).to(tl.float32)
    acc += (x.to(tl.float32) * tl.load(wp + 3).to(tl.float32)).to(DT).to(tl.float32)
    y = acc.to(DT).to(tl.float32)
    return (y / (1.0 + tl.exp(-y))).to(DT), s1, s2


@triton.jit
def _shift(cs, sct, s1, s2, x):
    tl.store(cs, s1)
    tl.store(cs + sct, s2)
    tl.store(cs + 2 * sct, x.to(cs.dtype.element_ty))


@triton.jit
def _onorm_head(po, w_o, pg, o_eps, V: tl.constexpr):
    """The V outputs at po (model dtype, every program's stored) -> rms_norm(., w_o, o_eps) * sigmoid(gate
    at pg), stored back at po: the model's rounding (the normed row to the model dtype, the sigmoid, the
    product)."""
    ov = tl.arange(0, V)
    DT = po.dtype.element_ty
    x = tl.load(po + ov, cache_modifier=".cg").to(tl.float32)
    y = (x * (1.0 / tl.sqrt(tl.sum(x * x, 0) / V + o_eps)) * tl.load(w_o + ov).to(tl.float32)).to(DT)
    s = tl.sigmoid(tl.load(pg + ov).to(tl.float32)).to(DT)
    tl.store(po + ov, (y.to(tl.float32) * s.to(tl.float32)).to(DT))


@triton.jit
def kda_step_decode_kernel(xq, xk, xv, cstate, cw, fa, fb, beta, a_log, dt_bias, state, o, cnt,
                           H, sxq, sxk, sxv, scm, scc, sct, sfa, sb, lower, scale, eps,
                           w_o, gate, sg, o_eps,
                           K: tl.constexpr, V: tl.constexpr, R: tl.constexpr, BV: tl.constexpr, P: tl.constexpr,
                           BR: tl.constexpr, QK_DT: tl.constexpr, F_DT: tl.constexpr, NORM: tl.constexpr = False):
    pid = tl.program_id(0)
    NB: tl.constexpr = V // BV // P          # value blocks per program
    i_p = pid % P
    h = (pid // P) % H
    m = (pid // P // H).to(tl.int64)
    DT = xq.dtype.element_ty
    CQ = H * K
    ok = tl.arange(0, K)
    # the first state tile first: its load has the longest way to come and depends on nothing
    ov0 = i_p * NB * BV + tl.arange(0, BV)
    ps0 = state + ((m * H + h) * K + ok[:, None]) * V + ov0[None, :]
    S0 = tl.load(ps0)
    cs_q = cstate + m * scm + (h * K + ok) * scc
    cs_k = cstate + m * scm + (CQ + h * K + ok) * scc
    qx = tl.load(xq + m * sxq + h * K + ok)
    kx = tl.load(xk + m * sxk + h * K + ok)
    q_raw, q1, q2 = _conv4(cs_q, sct, cw, h * K + ok, qx, DT)
    k_raw, k1, k2 = _conv4(cs_k, sct, cw, CQ + h * K + ok, kx, DT)
    g, qn, kn, b = _gate_qkb(fa, fb, beta, a_log, dt_bias, q_raw.to(tl.float32), k_raw.to(tl.float32), m, h, sfa, sb,
                             lower, scale, eps, ok, K, R, BR, QK_DT, F_DT)
    for j in tl.static_range(NB):
        if j == 0:
            ov, ps, S = ov0, ps0, S0
        else:
            ov = (i_p * NB + j) * BV + tl.arange(0, BV)
            ps = state + ((m * H + h) * K + ok[:, None]) * V + ov[None, :]
            S = tl.load(ps)
        cs_v = cstate + m * scm + (2 * CQ + h * V + ov) * scc
        vx = tl.load(xv + m * sxv + h * V + ov)
        v_c, v1, v2 = _conv4(cs_v, sct, cw, 2 * CQ + h * V + ov, vx, DT)
        tl.debug_barrier()            # every thread's window loads before any store of the shifted state
        _shift(cs_v, sct, v1, v2, vx)   # this program's own value channels
        _recur(S, ps, o + (m * H + h) * V + ov, g, qn, kn, b, v_c.to(tl.float32))
    # q, k channels: read by each of the head's P programs; the last to arrive shifts them
    if P == 1:
        _shift(cs_q, sct, q1, q2, qx)
        _shift(cs_k, sct, k1, k2, kx)
        if NORM:
            tl.debug_barrier()        # every thread's o stores before the head's outputs are read back
            _onorm_head(o + (m * H + h) * V, w_o, gate + m * sg + h * V, o_eps, V)
    else:
        tl.debug_barrier()            # every thread's q / k window loads (and o stores) ...
        done = tl.atomic_add(cnt + m * H + h, 1, sem="acq_rel", scope="gpu")   # ... before the count
        if done == P - 1:
            _shift(cs_q, sct, q1, q2, qx)
            _shift(cs_k, sct, k1, k2, kx)
            if NORM:
                _onorm_head(o + (m * H + h) * V, w_o, gate + m * sg + h * V, o_eps, V)
            tl.atomic_xchg(cnt + m * H + h, 0, sem="relaxed", scope="gpu")
