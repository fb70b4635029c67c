"""Triton kernel for the KDA decode step with its gate's up-projection (the `k3::kda_decode_fb` op).

One program per (token, head, block of BV value columns), as fla-core's fused_recurrent_kda (BV = 32,
4 warps): a head of K = V = 128 at M = 1 is 4 programs. Each program
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
"""
from __future__ import annotations

import triton
import triton.language as tl


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
    # the gate's up-projection for this head: f = fa[m] @ fb[h * K:(h + 1) * K].T
    acc = tl.zeros([K], tl.float32)
    for r0 in tl.static_range(0, R, BR):
        orr = r0 + tl.arange(0, BR)
        w = tl.load(fb + (h * K + ok)[:, None] * R + orr[None, :]).to(tl.float32)
        x = tl.load(fa + m * sfa + orr).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    f = acc.to(F_DT).to(tl.float32)
    g = lower * tl.sigmoid(tl.exp(tl.load(a_log + h).to(tl.float32))
                           * (f + tl.load(dt_bias + h * K + ok).to(tl.float32)))
    xq = tl.load(q + m * sq + h * K + ok).to(tl.float32)
    xk = tl.load(k + m * sk + h * K + ok).to(tl.float32)
    qn = (xq / tl.maximum(tl.sqrt(tl.sum(xq * xq, 0)), eps) * scale).to(QK_DT).to(tl.float32)
    kn = (xk / tl.maximum(tl.sqrt(tl.sum(xk * xk, 0)), eps)).to(QK_DT).to(tl.float32)
    b = tl.sigmoid(tl.load(beta + m * sb + h).to(tl.float32))
    vb = tl.load(v + m * sv + h * V + ov).to(tl.float32)
    S = S * tl.exp(g)[:, None]
    u = b * (vb - tl.sum(S * kn[:, None], 0))
    S = S + kn[:, None] * u[None, :]
    out = tl.sum(S * qn[:, None], 0)
    tl.store(o + (m * H + h) * V + ov, out.to(o.dtype.element_ty))
    tl.store(ps, S)
