"""Triton GEMV for decode: out[M, N] = x[M, K] @ W[N, K]^T with M <= 8 (bf16/fp16/fp32).

At decode batch sizes a GEMM is a weight read: the cuBLAS kernels the graph gets read 10-30 MB
weights at 1.2-2.9 TB/s on an H200 (bench/layer_bench.py --attribute, BENCHMARKS.md), against
~4.4 TB/s the memory gives. This kernel is only a weight stream: each program owns BLOCK_N rows of W
and walks K in BLOCK_K steps (the loop is software-pipelined, `num_stages` loads in flight), the
M rows of x broadcast against the [BLOCK_N, BLOCK_K] weight tile on CUDA cores (no tensor cores:
at M <= 8 they would idle), fp32 accumulation, one store per output. No split-K: the grid is
N / BLOCK_N programs, so BLOCK_N is chosen per shape to fill the SMs (the tuned table in
tuning.GEMV_TABLE, from bench/gemv_bench.py).

PDL=True (Programmatic Dependent Launch, Hopper; launched with `launch_pdl=True`): the weights never
depend on the previous kernel, so each program loads its first weight tile, then waits for the
previous kernel (`gdc_wait`) before it reads x, and lets the next kernel launch right away
(`gdc_launch_dependents`: the next one waits for this one's completion before reading what it
wrote). A chain of such GEMVs streams weights across kernel boundaries instead of ramping up and
draining each time, which a cuBLAS call cannot do. Across a chain of GEMVs that gains nothing (each
fills the GPU, so the next one's programs find no room early): a KDA step's six GEMMs took 81.6 us with
it, 77.6 without (`bench/gemv_bench.py --chain`, 2 x H200). After a one-program kernel that
triggers its dependents at its start (the TP=1 all-reduce / norm), with PF bytes of each program's rows
requested into L2 before the wait, it hides most of that kernel (gemm.gemv_pdl: 4.5-5 us per pair on
an H100, bench/pdl_probe.py).

`mma_gemm_kernel`: the same product on the tensor cores, for M <= 16 (one MMA tile of tokens,
rows past M masked to zero), split along K. The grid is (N / BN, SPLIT): each program streams a
[BN, K / SPLIT] slice of W through Triton's software pipeline (`num_stages` tiles of [BN, BK] in
flight, cp.async into shared memory) into one tl.dot accumulator, so a weight of few rows
(N = 1536, 2240) still spreads over every SM instead of leaving a part of them idle or running a
second, half-empty wave. SWAP puts the weight rows on the MMA's M side (W @ x^T: wgmma's 64-row
tiles on Hopper) instead of the tokens (x @ W^T: mma.sync 16 x 8 tiles). With SPLIT > 1 each
program stores its fp32 partial tile into `part` ([N / BN, SPLIT, BM, BN]) and counts itself in
with one acq_rel atomic on `cnt[tile]`; the program that arrives last sums the SPLIT partials in
split order (so the result does not depend on which one came last), writes out and sets the
counter back to 0, so every launch leaves the counters as it found them (zero) and nothing
separate clears them (CUDA-graph replays included). One launch; no fp32 output buffer, no atomics
on the data.
"""
from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def gemv_kernel(x, w, out, M, N, K, sxm, swn, som, w2, out2, N1, swn2, som2, MP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ACC: tl.constexpr,
                PDL: tl.constexpr = False, GDC: tl.constexpr = False,
                TWO: tl.constexpr = False, LAZY: tl.constexpr = False, PF: tl.constexpr = 0,
                LANES: tl.constexpr = 128):
    """ACC: out += x @ W^T (out read, added in fp32, written), else out = x @ W^T. PDL: the first
    weight tile read before x (needs K >= BLOCK_K); GDC: with the grid-dependency wait / launch
    between them (the module docstring; off in Triton's CPU interpreter, which lacks them).
    TWO: N rows stacked from w (its N1 rows, into out) and w2 (into out2), N1 a multiple of BLOCK_N
    (two_rows: each program's rows lie in one weight). LAZY: the products accumulate element-wise in
    an [MP, BLOCK_N, BLOCK_K] fp32 tile, summed along K once after the loop, instead of a cross-thread
    reduction every step (the loop body is then loads and FMAs only; the sum order differs, fp32 all
    the same); gemm.gemv takes it only where the tile fits 64 registers a thread.
    PF (with GDC): before the wait, the first PF bytes of the program's weight rows (contiguous: the
    caller checks swn == K and 16-byte alignment) are requested into L2, LANES threads issuing one bulk
    prefetch each (l2_prefetch_slice), so the weights stream while the kernel before this one (a
    one-program all-reduce / norm at decode) still runs."""
    pid = tl.program_id(0)
    w, swn, out, som, r0, nlim = two_rows(pid * BLOCK_N, N, w, swn, out, som, w2, out2, N1, swn2, som2, TWO)
    rn = r0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, MP)
    nmask = rn < nlim
    acc = tl.zeros([MP, BLOCK_N], tl.float32)
    acc3 = tl.zeros([MP, BLOCK_N, BLOCK_K] if LAZY else [1, 1, 1], tl.float32)
    wp = w + rn.to(tl.int64)[:, None] * swn
    k_start = 0
    if PDL:
        if GDC and PF > 0:
            rows = tl.minimum(nlim - r0, BLOCK_N)
            l2_prefetch_slice(w + r0.to(tl.int64) * swn, rows * K * (w.dtype.element_ty.primitive_bitwidth // 8), PF,
                              LANES)
        rk = tl.arange(0, BLOCK_K)
        wt = tl.load(wp + rk[None, :], mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
        if GDC:
            tl.extra.cuda.gdc_wait()               # the previous kernel's writes (x, out) are visible now
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start streaming its weights
        xt = tl.load(x + rm[:, None] * sxm + rk[None, :], mask=rm[:, None] < M, other=0.0)
        if LAZY:
            acc3 += xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :]
        else:
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            wt = tl.load(wp + rk[None, :], mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x + rm[:, None] * sxm + rk[None, :], mask=rm[:, None] < M, other=0.0)
        else:
            wt = tl.load(wp + rk[None, :], mask=nmask[:, None] & (rk[None, :] < K), other=0.0,
                         eviction_policy="evict_first")
            xt = tl.load(x + rm[:, None] * sxm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        xf = xt.to(tl.float32)
        if LAZY:
            acc3 += xf[:, None, :] * wt.to(tl.float32)[None, :, :]
        else:
            acc += tl.sum(xf[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
    if LAZY:
        acc = tl.sum(acc3, axis=2)
    op = out + rm[:, None] * som + rn[None, :]
    om = (rm[:, None] < M) & nmask[None, :]
    if ACC:
        acc += tl.load(op, mask=om, other=0.0).to(tl.float32)
    tl.store(op, acc.to(out.dtype.element_ty), mask=om)


@triton.jit
def l2_prefetch_slice(base, nbytes, PF: tl.constexpr, LANES: tl.constexpr):
    """Request the first min(PF, nbytes) bytes at `base` (16-byte aligned) into L2: lane i of LANES issues
    one Hopper bulk prefetch (`cp.async.bulk.prefetch.L2`) of PF // LANES bytes (a multiple of 16) at
    byte i * that; lanes past nbytes issue none. One element per thread when LANES is the program's
    thread count (no lane repeats another's request). l2_prefetch_rows with one row."""
    l2_prefetch_rows(base, 0, 1, nbytes, PF, 1, LANES)


@triton.jit
def l2_prefetch_rows(base, stride, nrows, row_bytes, PF_ROW: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr):
    """Request the first min(PF_ROW, row_bytes) bytes of each of the first nrows of ROWS rows (`stride` bytes
    apart, from `base`, 16-byte aligned) into L2: the LANES threads split as LANES // ROWS lanes per row (LANES a
    multiple of ROWS), each issuing one bulk prefetch (`cp.async.bulk.prefetch.L2`) of PF_ROW // that bytes."""
    PER: tl.constexpr = LANES // ROWS
    CH: tl.constexpr = max(16, PF_ROW // PER // 16 * 16)
    lane = tl.arange(0, LANES)
    r = lane // PER
    off = (lane % PER).to(tl.int64) * CH
    size = tl.where((r < nrows) & (off + CH <= row_bytes) & (off < PF_ROW), CH, 0).to(tl.int32)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                              "mov.u32 $0, 0; }", "=r,l,r",
                              [base.to(tl.pointer_type(tl.int8)) + r.to(tl.int64) * stride + off, size],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def two_rows(r0, N, w, swn, out, som, w2, out2, N1, swn2, som2, TWO: tl.constexpr):
    """(weight, its row stride, output, its row stride, first row, rows) of the program whose first
    stacked row is r0: with TWO, rows at or past N1 are w2's (into out2), else w's, whose rows are N1."""
    nlim = N
    if TWO:
        if r0 >= N1:        # this program's rows are w2's
            w = w2
            swn = swn2
            out = out2
            som = som2
            r0 = r0 - N1
            nlim = N - N1
        else:
            nlim = N1
    return w, swn, out, som, r0, nlim


@triton.jit(do_not_specialize=["M"])   # one compile for every M (M=1 would get its own)
def mma_gemm_kernel(x, w, out, part, cnt, M, N, K, sxm, swn, som, w2, out2, N1, swn2, som2,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                    SWAP: tl.constexpr, EVEN_K: tl.constexpr, ACC: tl.constexpr, TWO: tl.constexpr = False):
    """out (+)= x @ W^T on the tensor cores, K split over SPLIT programs per BN rows (module
    docstring). x [M <= BM, K], W [N, K] and out [M, N] with unit stride along K / N. `part` and
    `cnt` are unused when SPLIT == 1. TWO: W is two weights stacked, [w; w2] (rows [0, N1) of W are
    w's, rows [N1, N) w2's rows [0, N - N1)), and so is out: columns [0, N1) go to `out`, the rest
    to `out2` (row strides som / som2): one launch streams both, neither is copied. N1 must be a
    multiple of BN (each program's rows lie in one weight: it picks that weight's base as a scalar,
    so its loads stay 16-byte vectors; a per-row select of the two bases made them 2-byte loads).
    w2, out2, N1, swn2 and som2 are unused otherwise."""
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    w, swn, out, som, r0, nlim = two_rows(pid * BN, N, w, swn, out, som, w2, out2, N1, swn2, som2, TWO)
    rn = r0 + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    nmask = rn < nlim
    mmask = rm < M
    ks = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK          # K per split, a multiple of BK
    k_lo = sid * ks
    k_hi = tl.minimum(k_lo + ks, K)
    wp = w + rn.to(tl.int64)[:, None] * swn
    xp = x + rm[:, None] * sxm
    if SWAP:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        rk = k0 + tl.arange(0, BK)
        if EVEN_K:
            wt = tl.load(wp + rk[None, :], mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
            xm = mmask[:, None]
        else:
            wt = tl.load(wp + rk[None, :], mask=nmask[:, None] & (rk[None, :] < K), other=0.0,
                         eviction_policy="evict_first")
            xm = mmask[:, None] & (rk[None, :] < K)
        xt = tl.load(xp + rk[None, :], mask=xm, other=0.0)
        if SWAP:
            acc = tl.dot(wt, tl.trans(xt), acc)
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
    if SWAP:
        acc = tl.trans(acc)
    op = out + rm[:, None] * som + rn[None, :]
    om = mmask[:, None] & nmask[None, :]
    if SPLIT == 1:
        if ACC:
            acc += tl.load(op, mask=om, other=0.0).to(tl.float32)
        tl.store(op, acc.to(out.dtype.element_ty), mask=om)
    else:
        offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        base = part + pid.to(tl.int64) * (SPLIT * BM * BN)
        tl.store(base + sid * (BM * BN) + offs, acc)
        tl.debug_barrier()                                   # every thread's partial is stored ...
        done = tl.atomic_add(cnt + pid, 1, sem="acq_rel", scope="gpu")   # ... before the count
        if done == SPLIT - 1:                                # the last of the tile's programs
            tot = tl.zeros([BM, BN], tl.float32)
            for s in tl.static_range(SPLIT):
                tot += tl.load(base + s * (BM * BN) + offs, cache_modifier=".cg")
            if ACC:
                tot += tl.load(op, mask=om, other=0.0).to(tl.float32)
            tl.store(op, tot.to(out.dtype.element_ty), mask=om)
            tl.atomic_xchg(cnt + pid, 0, sem="relaxed", scope="gpu")


@triton.jit
def head_bmm_kernel(x, w, out, gate, M, H, N, K, sxh, sxm, sxk, swh, swk, swn, sgm, sgh, sgn,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, GATE: tl.constexpr):
    """out[h, m, n] = sum_k x[h, m, k] * w[h, k, n] for a per-head weight at decode batch sizes (the MLA
    query absorption and value up-projection): grid (H, N / BN), each program streams its [K, BN]
    slice of head h's weight (any strides: w[h] stored [K, N] or [N, K]) through one tl.dot per K
    step, the token rows padded to one BM tile (rows past M masked), fp32 accumulation. out is stored
    [M, H, N] (token-major: what the graph's permute back and reshape read without a copy). GATE:
    the product, rounded to out's dtype, times sigmoid(gate[m, h, n]) (rounded the same way), as the
    model's `bmm(...) * sigmoid(gate)` in its dtype. IEEE (fp32 inputs): full-precision fp32
    products, not TF32, as torch.bmm."""
    h = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = offs_n < N
    for m0 in range(0, M, BM):
        offs_m = m0 + tl.arange(0, BM)
        mm = offs_m < M
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            mk = offs_k < K
            a = tl.load(x + h * sxh + offs_m[:, None] * sxm + offs_k[None, :] * sxk,
                        mask=mm[:, None] & mk[None, :], other=0.0)
            b = tl.load(w + h * swh + offs_k[:, None] * swk + offs_n[None, :] * swn,
                        mask=mk[:, None] & mn[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        y = acc.to(out.dtype.element_ty)
        if GATE:
            g = tl.load(gate + offs_m[:, None] * sgm + h * sgh + offs_n[None, :] * sgn,
                        mask=mm[:, None] & mn[None, :], other=0.0).to(tl.float32)
            y = (y.to(tl.float32) * tl.sigmoid(g).to(out.dtype.element_ty).to(tl.float32)).to(out.dtype.element_ty)
        tl.store(out + (offs_m[:, None] * H + h) * N + offs_n[None, :], y, mask=mm[:, None] & mn[None, :])
