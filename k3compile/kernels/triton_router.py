"""Triton kernel for the MoE router's top-k selection (the `k3::router_topk` op).

One program per token row: sigmoid of the fp32 router logits, plus the correction bias, then the
k largest keys of the row held in registers (SORT, the default: Triton's bitonic tl.topk in one
pass; else k rounds of (max, mask it out)), then the selected *unbiased* scores
renormalised to sum 1 times the routed scaling factor, the K3 router of K3-SPEC.md (noaux_tc, one
group). It replaces what the unfused graph launches for this (an elementwise kernel, torch.topk's
radix select + sort, a gather/sum/div kernel).

Both forms order packed keys (each round of the rounds form is ONE reduction): the biased score
and the expert index are packed into one int64 key,
the score's fp32 bits made order-preserving as a signed int (negative floats: bits ^ 0x7FFFFFFF) in
the high word, (BLOCK - 1 - index) in the low word, so the maximum key is the highest score and,
among equal scores, the lowest index (torch.topk leaves the order of ties unspecified). A NaN
score sorts above every number, as in torch.topk. The selected weights are gathered from the
logits after the loop. (The first version did three block reductions per round, max, lowest
index holding it, and the weight: 48 for top-16; bench/results in BENCHMARKS.md "router top-k".)
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def topk_row(lrow, bias, ids_row, w_row, E, scale, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
             SORT: tl.constexpr):
    """The selection of one token: its E logits at lrow -> K ids at ids_row and weights at w_row."""
    offs = tl.arange(0, BLOCK)
    m = offs < E
    lg = tl.load(lrow + offs, mask=m, other=0.0)
    s = tl.sigmoid(lg.to(tl.float32))
    bits = (s + tl.load(bias + offs, mask=m, other=0.0).to(tl.float32)).to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    low = (BLOCK - 1 - offs).to(tl.int64)
    key = tl.where(m, (key << 32) | low, -9223372036854775807 - 1)  # int64 min: never selected
    kk = tl.arange(0, KP)
    if SORT and KP > 1:  # the KP largest keys at once, in order (Triton's bitonic top-k: no round per
        # selection; top-1 takes the max: Triton 3.8's tl.topk(x, 1) fails to reshape its scalar result)
        sel = BLOCK - 1 - (tl.topk(key, KP) & 0xFFFFFFFF).to(tl.int32)
    else:
        sel = tl.zeros([KP], tl.int32)
        for j in tl.static_range(K):
            top = tl.max(key, 0)
            i = BLOCK - 1 - (top & 0xFFFFFFFF).to(tl.int32)
            sel = tl.where(kk == j, i, sel)
            key = tl.where(offs == i, -9223372036854775807 - 1, key)
    ok = kk < K
    ws = tl.sigmoid(tl.load(lrow + sel, mask=ok, other=0.0).to(tl.float32))
    ws = tl.where(ok, ws, 0.0)
    tot = tl.sum(ws, 0)
    tl.store(ids_row + kk, sel.to(ids_row.dtype.element_ty), mask=ok)
    tl.store(w_row + kk, ws / tot * scale, mask=ok)


@triton.jit
def router_topk_kernel(logits, bias, ids, w, E, scale, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                       SORT: tl.constexpr = False):
    r = tl.program_id(0).to(tl.int64)
    topk_row(logits + r * E, bias, ids + r * K, w + r * K, E, scale, K, KP, BLOCK, SORT)
