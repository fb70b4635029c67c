"""Triton kernel for the MoE router's top-k selection (the `k3::router_topk` op).

One program per token row: sigmoid of the fp32 router logits, plus the correction bias, then k
rounds of (max, lowest index holding it, mask it out) over the row held in registers, then the
selected *unbiased* scores renormalised to sum 1 times the routed scaling factor, the K3 router
of K3-SPEC.md (noaux_tc, one group). It replaces what the unfused graph launches for this (an
elementwise kernel, torch.topk's radix select + sort, a gather/sum/div kernel). Ties go to the
lower expert index (torch.topk leaves their order unspecified). A row with a NaN logit has no
maximum to find; its ids then fall back to expert 0 rather than an out-of-range index.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def router_topk_kernel(logits, bias, ids, w, E, scale, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < E
    s = tl.sigmoid(tl.load(logits + r * E + offs, mask=m, other=0.0).to(tl.float32))
    v = tl.where(m, s + tl.load(bias + offs, mask=m, other=0.0).to(tl.float32), float("-inf"))
    kk = tl.arange(0, KP)
    sel = tl.zeros([KP], tl.int32)
    ws = tl.zeros([KP], tl.float32)
    for j in tl.static_range(K):
        top = tl.max(v, 0)
        i = tl.min(tl.where(v == top, offs, BLOCK), 0)
        i = tl.where(i < E, i, 0)
        sel = tl.where(kk == j, i, sel)
        ws = tl.where(kk == j, tl.sum(tl.where(offs == i, s, 0.0), 0), ws)
        v = tl.where(offs == i, float("-inf"), v)
    tot = tl.sum(ws, 0)  # entries kk >= K are 0
    tl.store(ids + r * K + kk, sel.to(tl.int64), mask=kk < K)
    tl.store(w + r * K + kk, ws / tot * scale, mask=kk < K)
