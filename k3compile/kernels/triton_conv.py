"""Triton kernel for the KDA short convolution at decode (the `k3::kda_conv_decode` op).

One program per (row, block of channels): the channel's last KW - 1 inputs from the conv state,
the new input from the q, k or v projection slice it belongs to (x = [xq | xk | xv]), the
depthwise products rounded to the model dtype (as the model's `cols * w` in bf16), summed in fp32
and rounded, SiLU in fp32, stored into the contiguous q, k or v output; the window's last KW - 1
inputs go to new_state. It replaces Inductor's window concatenation, state-copy slice, conv + SiLU
and the three contiguous copies of q, k and v the recurrence op takes (one kernel for five).
new_state may be the state itself (k3::kda_conv_decode_, in place): each thread reads a channel's
position t before it writes position t - 1 of the same channel, and no other thread touches them.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kda_conv_decode_kernel(xq, xk, xv, state, w, q, k, v, new_state, CQ, sxq, sxk, sxv, ssm, ssc, sst,
                           snm, snc, snt, KW: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < 3 * CQ
    part = c // CQ
    j = c % CQ
    dt = q.dtype.element_ty
    x = tl.load(xq + m * sxq + j, mask=ok & (part == 0), other=0.0)
    x = tl.where(part == 1, tl.load(xk + m * sxk + j, mask=ok & (part == 1), other=0.0), x)
    x = tl.where(part == 2, tl.load(xv + m * sxv + j, mask=ok & (part == 2), other=0.0), x)
    acc = tl.zeros([BLOCK], tl.float32)
    ns = new_state + m * snm + c * snc
    for t in tl.static_range(KW - 1):
        st = tl.load(state + m * ssm + c * ssc + t * sst, mask=ok, other=0.0)
        acc += (st.to(tl.float32) * tl.load(w + c * KW + t, mask=ok, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        if t > 0:
            tl.store(ns + (t - 1) * snt, st, mask=ok)
    acc += (x.to(tl.float32) * tl.load(w + c * KW + (KW - 1), mask=ok, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(ns + (KW - 2) * snt, x.to(new_state.dtype.element_ty), mask=ok)
    y = acc.to(dt).to(tl.float32)
    y = (y / (1.0 + tl.exp(-y))).to(dt)
    tl.store(q + m * CQ + j, y, mask=ok & (part == 0))
    tl.store(k + m * CQ + j, y, mask=ok & (part == 1))
    tl.store(v + m * CQ + j, y, mask=ok & (part == 2))
