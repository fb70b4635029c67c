"""Triton kernel of `k3::residual_norm_gemm`: the residual add + AttnRes / RMSNorm of a layer's input
folded into the decode GEMM that reads it (TP=1: no all-reduce between them).

The op computes `upd = res + delta` and `out = AttnResNorm(upd, blocks; w_norm, w_qk, g) @ W^T`
(K3-SPEC.md section 2; model.functional.attnres_mix). Separately that is one small kernel (the
residual/norm kernel of kernels/triton_comm.py, one program per token row: 5-6 us at one token on an
H200, latency of its three block reductions) and then the GEMM. Folded, the GEMM's programs never
wait for a normed row: every quantity the norm needs is linear in the GEMM's own x tiles or a sum
over K, so it accumulates in the same loop:

  the S = NB + 1 sources (the blocks, then upd) of each of the M tokens are stacked as the rows of
  the MMA's x tile (row s * M + m; S * M <= 16, one tile), each scaled by g along K, so the one
  tensor-core product gives acc[s*M + m, n] = sum_k src[s, m, k] g[k] W[n, k];
  G = X X^T (a 16 x 16 tl.dot per K step: each source's sum of squares and every cross product),
  l[s*M + m] = sum_k src[s, m, k] w_norm[k] w_qk[k] (the AttnRes logits before their 1/rms).

At the end (after the split-K partials of acc, G and l are summed, as mma_gemm_kernel sums acc):
  r_s = rsqrt(G_ss / K + eps), p = softmax_s(r_s * l_s) per token (AttnRes weights; p = 1 when NB == 0),
  mixed = sum_s p_s src_s, so mean(mixed^2) = p^T G p / K and
  out[m, n] = rsqrt(p^T G p / K + eps) * sum_s p_s acc[s*M + m, n].
This is the reference's math up to rounding: the reference rounds the normed sources (for the logits),
`mixed` and the normed row to the model dtype; here only x * g is rounded (the MMA's operand) and the
rest stays fp32. So the result is within the model dtype's rounding of the reference, not bitwise.
`upd` IS exact (the same fp32 sum rounded once); the programs of the first column tile write it, each
its K range.

The grid, the split-K partials and the arrival counters are mma_gemm_kernel's (triton_gemv.py): grid
(N / BN, SPLIT), each program streams its [BN, K / SPLIT] weight slice through Triton's software
pipeline; with SPLIT > 1 each stores its fp32 acc, G and l partials and the last to arrive sums them in
split order, finishes and sets the counter back to zero.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_gemv import two_rows
from .triton_router import topk_after_tile


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """tl.dot(a, b, acc), full-precision fp32 where IEEE (fp32 operands: the CPU tests' dtype)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _scaled_step(x, g, rk, km, wt, acc, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """One K step of the folded GEMMs: the fp32 x rows times g (rounded to the weight's dtype, the model
    dtype: the MMA's operand) against the weight tile, into acc ([BN, BM] where SWAP, else [BM, BN])."""
    xs = (x * tl.load(g + rk, mask=km, other=0.0).to(tl.float32)[None, :]).to(wt.dtype)
    if SWAP:
        acc = _dot(wt, tl.trans(xs), acc, IEEE)
    else:
        acc = _dot(xs, tl.trans(wt), acc, IEEE)
    return acc


@triton.jit
def _pick(b0, b1, b2, b3, b4, b5, b6, b7, S: tl.constexpr):
    """The pointer of block S (a compile-time choice among the eight block arguments)."""
    p = b0
    if S == 1:
        p = b1
    if S == 2:
        p = b2
    if S == 3:
        p = b3
    if S == 4:
        p = b4
    if S == 5:
        p = b5
    if S == 6:
        p = b6
    if S == 7:
        p = b7
    return p


@triton.jit
def _finish(acc, G, L, rm, M, K, eps, NB: tl.constexpr):
    """out tile [BM, BN] (token rows) from the summed acc [BM (source rows), BN], G [BM, BM], l [BM]."""
    valid = rm < (NB + 1) * M
    tok = rm % M
    same = (tok[:, None] == tok[None, :]) & valid[:, None] & valid[None, :]
    if NB > 0:
        gd = tl.sum(tl.where(rm[:, None] == rm[None, :], G, 0.0), 1)
        logit = tl.where(valid, tl.math.rsqrt(gd / K + eps) * L, float("-inf"))
        mx = tl.max(tl.where(same, logit[None, :], float("-inf")), 1)
        e = tl.where(valid, tl.exp(tl.where(valid, logit, 0.0) - tl.where(valid, mx, 0.0)), 0.0)
        den = tl.sum(tl.where(same, e[None, :], 0.0), 1)
        p = tl.where(valid, e / tl.where(valid, den, 1.0), 0.0)
    else:
        p = tl.where(valid, 1.0, 0.0)
    t = tl.sum(tl.where(same, G * p[None, :], 0.0), 1)            # t_r = sum over r's token of G[r, .] p
    q = tl.sum(tl.where(same, (p * t)[None, :], 0.0), 1)          # p^T G p of r's token
    coef = tl.where(valid, p * tl.math.rsqrt(q / K + eps), 0.0)
    C = tl.where((tok[None, :] == rm[:, None]) & valid[None, :], coef[None, :], 0.0)   # [token, source row]
    return tl.dot(C, acc, input_precision="ieee")


@triton.jit
def resnorm_gemm_kernel(res, od, o0, o1, o2, o3, o4, o5, o6, o7, upd, g, w_norm, w_qk, w, out, part, cnt,
                        M, N, K, eps, swn, som, w2, out2, N1, swn2, som2, tcnt, bias, ids, tw, tscale,
                        NB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        SPLIT: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                        ALIGNED: tl.constexpr, TWO: tl.constexpr = False, TOPK: tl.constexpr = 0,
                        KP: tl.constexpr = 1, EB: tl.constexpr = 1, SORT: tl.constexpr = False):
    """upd = res + delta; out = AttnResNorm(upd, blocks) @ W^T (module docstring). res, delta and the
    blocks are [M, K] contiguous (row stride K); delta and block s are addressed as res + od / res + o{s}
    (element offsets from res: one pointer, so the tile is ONE load per K step, ONE pipelined shared-
    memory buffer as in mma_gemm_kernel). The tile's rows: the blocks' (s * M + m), res's (NB * M + m),
    delta's ((NB + 1) * M + m); a 0/1 matrix T (one small tl.dot, exact in fp32) turns them into the
    sources, upd = res + delta rounded to the model dtype as the reference rounds it. W [N, K] and out
    [M, N] with unit stride along K / N; (NB + 2) * M <= BM. ALIGNED: every offset a multiple of 8
    elements (16-byte vector loads). TWO: W is two weights stacked, [w; w2], and so is out ([out | out2]),
    as in mma_gemm_kernel (N1 = w's rows, a multiple of BN; w2, out2, N1, swn2, som2 unused otherwise):
    the router and the latent down-projection of the MoE input in one launch. TOPK > 0: the router's
    selection in the launch's router epilogue, as mma_gemm_kernel's (tcnt..tscale unused otherwise)."""
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    DT = out.dtype.element_ty
    lg = out
    slg = som
    w, swn, out, som, r0, nlim = two_rows(pid * BN, N, w, swn, out, som, w2, out2, N1, swn2, som2, TWO)
    rn = r0 + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    nmask = rn < nlim
    ks = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
    k_lo = sid * ks
    k_hi = tl.minimum(k_lo + ks, K)
    wp = w + rn.to(tl.int64)[:, None] * swn
    us = (rm >= NB * M) & (rm < NB * M + M)          # res's rows, which become upd's
    ds = (rm >= NB * M + M) & (rm < NB * M + 2 * M)  # delta's rows
    live = rm < NB * M + 2 * M
    rowoff = (rm - NB * M).to(tl.int64) * K
    rowoff = tl.where(ds, od + (rm - NB * M - M).to(tl.int64) * K, rowoff)
    for s in tl.static_range(NB):
        rowoff = tl.where((rm >= s * M) & (rm < s * M + M),
                          _pick(o0, o1, o2, o3, o4, o5, o6, o7, s) + (rm - s * M).to(tl.int64) * K, rowoff)
    rowoff = tl.where(live, rowoff, 0)
    if ALIGNED:
        rowoff = tl.multiple_of(rowoff, 8)
    T = ((rm[:, None] == rm[None, :]) & (rm[:, None] < NB * M + M)) | (us[:, None] & (rm[None, :] == rm[:, None] + M))
    T = T.to(DT)
    if SWAP:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    G = tl.zeros([BM, BM], tl.float32)
    L = tl.zeros([BM], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        rk = k0 + tl.arange(0, BK)
        km = rk < K     # the x loads (small, from L2) keep the K mask; the weight's only where K is ragged
        if EVEN_K:
            wt = tl.load(wp + rk[None, :], mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
        else:
            wt = tl.load(wp + rk[None, :], mask=nmask[:, None] & km[None, :], other=0.0,
                         eviction_policy="evict_first")
        xr = tl.load(res + rowoff[:, None] + rk[None, :], mask=live[:, None] & km[None, :], other=0.0)
        x = _dot(T, xr, tl.zeros([BM, BK], tl.float32), IEEE)
        xb = x.to(DT)                     # the blocks exact, upd's rows rounded once
        if pid == 0:
            tl.store(upd + (rm - NB * M)[:, None] * K + rk[None, :], xb, mask=us[:, None] & km[None, :])
        x = xb.to(tl.float32)
        G = _dot(xb, tl.trans(xb), G, IEEE)
        if NB > 0:
            wq = tl.load(w_norm + rk, mask=km, other=0.0).to(tl.float32) * tl.load(w_qk + rk, mask=km, other=0.0).to(tl.float32)
            L += tl.sum(x * wq[None, :], 1)
        acc = _scaled_step(x, g, rk, km, wt, acc, SWAP, IEEE)
    if SWAP:
        acc = tl.trans(acc)
    op = out + rm[:, None] * som + rn[None, :]
    om = (rm < M)[:, None] & nmask[None, :]
    if SPLIT == 1:
        tl.store(op, _finish(acc, G, L, rm, M, K, eps, NB).to(DT), mask=om)
        if TOPK > 0:
            if pid * BN < N1:
                topk_after_tile(tcnt, tl.cdiv(N1, BN), lg, slg, bias, ids, tw, M, N1, tscale, TOPK, KP, EB, SORT)
    else:
        PS: tl.constexpr = BM * BN + BM * BM + BM     # one program's partials: acc, G, l
        offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        goff = BM * BN + tl.arange(0, BM)[:, None] * BM + tl.arange(0, BM)[None, :]
        loff = BM * BN + BM * BM + tl.arange(0, BM)
        base = part + pid.to(tl.int64) * (SPLIT * PS)
        tl.store(base + sid * PS + offs, acc)
        tl.store(base + sid * PS + goff, G)
        tl.store(base + sid * PS + loff, L)
        tl.debug_barrier()                                   # every thread's partials are stored ...
        done = tl.atomic_add(cnt + pid, 1, sem="acq_rel", scope="gpu")   # ... before the count
        if done == SPLIT - 1:                                # the last of the tile's programs
            acc = tl.zeros([BM, BN], tl.float32)
            G = tl.zeros([BM, BM], tl.float32)
            L = tl.zeros([BM], tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(base + s * PS + offs, cache_modifier=".cg")
                G += tl.load(base + s * PS + goff, cache_modifier=".cg")
                L += tl.load(base + s * PS + loff, cache_modifier=".cg")
            tl.store(op, _finish(acc, G, L, rm, M, K, eps, NB).to(DT), mask=om)
            tl.atomic_xchg(cnt + pid, 0, sem="relaxed", scope="gpu")
            if TOPK > 0:
                if pid * BN < N1:
                    topk_after_tile(tcnt, tl.cdiv(N1, BN), lg, slg, bias, ids, tw, M, N1, tscale, TOPK, KP, EB,
                                    SORT)


@triton.jit
def tail_gemm_kernel(y, tw, g, w, sp, out, part, cnt, M, N, K, eps, swn, ssp, som,
                     TOPK: tl.constexpr, BM: tl.constexpr, BX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     SPLIT: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """The latent tail at TP=1 in one launch: out = sp + RMSNorm(sum_t tw[m, t] y[m, t, :], g) @ W^T.

    y [M, TOPK, K] contiguous (the routed experts' unfinalised outputs), tw [M, TOPK] contiguous (their
    weights), sp [M, N] (the shared expert's output), W [N, K]; M * TOPK <= BX. Per K step ONE load of
    the [BX, BK] tile of y's rows (row m * TOPK + t) and one fp32 product with the [BM, BX] matrix of
    the weights (row m holds token m's weights in its TOPK columns) forms the finalized rows, fp32 as
    the reference's sum (3xTF32 on the GPU, about fp32's precision), rounded to the model dtype as the
    reference rounds `routed`. Their squares accumulate over K; the GEMM takes routed * g (rounded) and
    the end scales each row by rsqrt(mean(routed^2) + eps) and adds sp, rounding once (the reference
    rounds the normed row, the product and the sum: within the dtype's rounding, not bitwise). Grid,
    split-K partials (acc and the squares) and counters as resnorm_gemm_kernel."""
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    DT = out.dtype.element_ty
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rx = tl.arange(0, BX)
    nmask = rn < N
    xlive = rx < M * TOPK
    ks = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
    k_lo = sid * ks
    k_hi = tl.minimum(k_lo + ks, K)
    wp = w + rn.to(tl.int64)[:, None] * swn
    yp = y + rx.to(tl.int64)[:, None] * K
    twv = tl.load(tw + rx, mask=xlive, other=0.0).to(tl.float32)
    T = tl.where((rx[None, :] // TOPK) == rm[:, None], twv[None, :], 0.0)     # [BM, BX]
    if SWAP:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        rk = k0 + tl.arange(0, BK)
        km = rk < K
        if EVEN_K:
            wt = tl.load(wp + rk[None, :], mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
        else:
            wt = tl.load(wp + rk[None, :], mask=nmask[:, None] & km[None, :], other=0.0,
                         eviction_policy="evict_first")
        yt = tl.load(yp + rk[None, :], mask=xlive[:, None] & km[None, :], other=0.0).to(tl.float32)
        if IEEE:
            x = tl.dot(T, yt, input_precision="ieee")
        else:
            x = tl.dot(T, yt, input_precision="tf32x3")
        x = x.to(DT).to(tl.float32)       # routed, rounded as the reference rounds it
        ss += tl.sum(x * x, 1)
        acc = _scaled_step(x, g, rk, km, wt, acc, SWAP, IEEE)
    if SWAP:
        acc = tl.trans(acc)
    om = (rm < M)[:, None] & nmask[None, :]
    op = out + rm[:, None] * som + rn[None, :]
    spp = sp + rm[:, None] * ssp + rn[None, :]
    if SPLIT == 1:
        r = tl.math.rsqrt(ss / K + eps)
        tl.store(op, (acc * r[:, None] + tl.load(spp, mask=om, other=0.0).to(tl.float32)).to(DT), mask=om)
    else:
        PS: tl.constexpr = BM * BN + BM                      # one program's partials: acc, the squares
        offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        soff = BM * BN + tl.arange(0, BM)
        base = part + pid.to(tl.int64) * (SPLIT * PS)
        tl.store(base + sid * PS + offs, acc)
        tl.store(base + sid * PS + soff, ss)
        tl.debug_barrier()                                   # every thread's partials are stored ...
        done = tl.atomic_add(cnt + pid, 1, sem="acq_rel", scope="gpu")   # ... before the count
        if done == SPLIT - 1:                                # the last of the tile's programs
            acc = tl.zeros([BM, BN], tl.float32)
            ss = tl.zeros([BM], tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(base + s * PS + offs, cache_modifier=".cg")
                ss += tl.load(base + s * PS + soff, cache_modifier=".cg")
            r = tl.math.rsqrt(ss / K + eps)
            tl.store(op, (acc * r[:, None] + tl.load(spp, mask=om, other=0.0).to(tl.float32)).to(DT), mask=om)
            tl.atomic_xchg(cnt + pid, 0, sem="relaxed", scope="gpu")
