"""Column-split forms of the all-reduce / norm kernels of triton_comm, for a few rows (decode).

triton_comm's kernels give each program whole rows: at M = 1 one program (one SM) loads every
source row and runs the norms' reductions one after another, about 6 us at N = 7168 on an H200
where the bytes take well under 1 us. Here each program takes W columns of every row, and each
full-row reduction becomes per-program partial sums exchanged once: every program stores its
partials in a small global workspace, meets the others at a grid barrier (`_grid_barrier`), and
sums all programs' partials itself, in program order (deterministic, the same in every program).

AttnRes (spec section 2) needs, per row and source i (the blocks, then the updated row), the source's
sum of squares and its dot with the query w_norm * w_qk (the softmax logits), and for the output
RMSNorm the mean square of the mixed row sum_i p_i x_i, which is sum_ij p_i p_j <x_i, x_j>: one
exchange of the sources' Gram matrix and query dots covers all three. Differences from the row
kernels (and the reference), all in fp32: a logit is rsqrt(mean(x^2) + eps) * (x . q) (the reference
rounds the normed row to the model dtype before the dot), and the output norm's mean square is that
of the mixed row before its rounding. The tests bound both against the reference. RND (constexpr,
triton_comm's): RND & 1 rounds the normed row to the model dtype before the weight multiply; the logits
are the fp32 form whatever RND & 2 says (exactly the model's where it keeps its keys in fp32); RND & 4
keeps the mixed row in fp32 for the output norm.

The grid barrier needs every program resident at once: comm.cols_plan keeps the programs well
under the SM count. Under TRITON_INTERPRET=1 the programs run one after another, so the launch
splits the kernel at the barrier into two launches (PHASE 1: everything up to the partials; PHASE 2:
the rest, re-reading the updated row it stored); on the GPU it is one launch (PHASE 0).
At WORLD > 1 the all-reduce is triton_comm's one-shot protocol with one barrier slot per program:
each program copies its columns of this rank's partial into its buffer, signals, and sums its
columns from every rank's buffer.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_comm import _epoch_end, _half, _signal, _sum_peers, _wait


@triton.jit
def _grid_barrier(bar, GEN: tl.constexpr):
    """Every program of this launch meets here. bar: int32 in global memory, the arrivals at bar[0],
    the generation at bar[GEN]: each program reads the generation, arrives; the last one resets the
    arrivals and bumps the generation, which releases the others. Self-resetting, so graph replays
    reuse it."""
    tl.debug_barrier()   # this program's stores (its partials) happen before its arrival
    gen = tl.atomic_add(bar + GEN, 0, sem="acquire", scope="gpu")
    n = tl.atomic_add(bar, 1, sem="acq_rel", scope="gpu")
    if n == tl.num_programs(0) - 1:
        tl.atomic_xchg(bar, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(bar + GEN, 1, sem="release", scope="gpu")
    else:
        while tl.atomic_add(bar + GEN, 0, sem="acquire", scope="gpu") == gen:
            pass
    tl.debug_barrier()


@triton.jit
def grid_barrier_probe_kernel(bar, GEN: tl.constexpr):
    """bench/cols_probe.py: the grid barrier alone."""
    _grid_barrier(bar, GEN)


@triton.jit
def _put(X, si, K: tl.constexpr, b, off2, mask2, NB: tl.constexpr):
    """X with block K's rows (fp32) at source index K, when there is such a block (K < NB)."""
    if K < NB:
        X = tl.where(si == K, tl.load(b + off2, mask=mask2, other=0.0).to(tl.float32)[:, None, :], X)
    return X


@triton.jit
def ar_norm_cols_kernel(
    ptrs, pads, epoch, HALF, local, res, upd, nrm, g, w_norm, w_qk,
    b0, b1, b2, b3, b4, b5, b6, b7, bar, slots,
    M, N, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, NB: tl.constexpr, HAS_RES: tl.constexpr,
    ROWS: tl.constexpr, W: tl.constexpr, S_PAD: tl.constexpr, P_PAD: tl.constexpr,
    DTYPE: tl.constexpr, SEQ: tl.constexpr, VEC: tl.constexpr, PHASE: tl.constexpr,
    GEN: tl.constexpr = 32, SYNC: tl.constexpr = True, RND: tl.constexpr = 0,
):
    """upd = res + sum_ranks(local); nrm = AttnRes post-norm of upd over NB blocks (RMSNorm(g) when
    NB == 0): triton_comm.ar_residual_norm_kernel's outputs with HAS_NORM, columns split over the
    programs (W each), all M <= ROWS rows in each program."""
    pid = tl.program_id(0)
    npid = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = pid * W + tl.arange(0, W)
    mask2 = (rows < M)[:, None] & (cols < N)[None, :]
    off2 = rows[:, None] * N + cols[None, :]
    base = _half(epoch, HALF, WORLD)
    SL: tl.constexpr = S_PAD * S_PAD + S_PAD        # one row's partials: Gram matrix, query dots
    if PHASE != 2:
        if WORLD > 1:
            mine = tl.load(ptrs + RANK).to(tl.pointer_type(DTYPE)) + base
            tl.store(mine + off2, tl.load(local + off2, mask=mask2), mask=mask2)
            _signal(pads, pid, epoch, RANK, WORLD, SEQ, VEC)
    # the sources this program needs besides the updated row: loaded before any wait
    si = tl.arange(0, S_PAD)[None, :, None]
    X = tl.zeros([ROWS, S_PAD, W], tl.float32)
    X = _put(X, si, 0, b0, off2, mask2, NB)
    X = _put(X, si, 1, b1, off2, mask2, NB)
    X = _put(X, si, 2, b2, off2, mask2, NB)
    X = _put(X, si, 3, b3, off2, mask2, NB)
    X = _put(X, si, 4, b4, off2, mask2, NB)
    X = _put(X, si, 5, b5, off2, mask2, NB)
    X = _put(X, si, 6, b6, off2, mask2, NB)
    cm = cols < N
    wq = tl.load(w_norm + cols, mask=cm, other=0.0).to(tl.float32) * \
        tl.load(w_qk + cols, mask=cm, other=0.0).to(tl.float32)
    gw = tl.load(g + cols, mask=cm, other=0.0).to(tl.float32)
    if PHASE != 2:
        if HAS_RES:
            r = tl.load(res + off2, mask=mask2, other=0.0).to(tl.float32)
        if WORLD > 1:
            _wait(pads, pid, epoch, RANK, WORLD, SEQ, VEC)
        y = _sum_peers(ptrs, base, local, off2, mask2, WORLD, DTYPE)   # WORLD == 1: local itself
        y = y.to(DTYPE).to(tl.float32)                 # the all-reduce result, rounded
        if HAS_RES:
            y = (r + y).to(DTYPE).to(tl.float32)
        tl.store(upd + off2, y.to(DTYPE), mask=mask2)
    else:
        y = tl.load(upd + off2, mask=mask2, other=0.0).to(tl.float32)
    X = tl.where(si == NB, y[:, None, :], X)
    sj = tl.arange(0, S_PAD)[None, None, :]
    ri = tl.arange(0, ROWS)[:, None, None]
    if PHASE != 2:
        d = tl.sum(X * wq[None, None, :], axis=2)        # [ROWS, S_PAD]: sources . query
        G = tl.zeros([ROWS, S_PAD, S_PAD], tl.float32)
        for j in tl.static_range(NB + 1):
            xj = tl.sum(tl.where(si == j, X, 0.0), axis=1)                     # [ROWS, W]
            G = tl.where(sj == j, tl.sum(X * xj[:, None, :], axis=2)[:, :, None], G)
        mine_s = slots + pid * (ROWS * SL)
        tl.store(mine_s + ri * SL + si * S_PAD + sj, G)
        tl.store(mine_s + rows[:, None] * SL + S_PAD * S_PAD + tl.arange(0, S_PAD)[None, :], d)
        if WORLD > 1:
            _epoch_end(epoch)   # every read of the peers' buffers is done
    if PHASE == 0 and SYNC:   # SYNC=0: bench/cols_probe.py only (the partials then race)
        _grid_barrier(bar, GEN)
    if PHASE != 1:
        pp = tl.arange(0, P_PAD)[:, None, None]
        pm = pp < npid
        k2 = tl.arange(0, S_PAD * S_PAD)[None, None, :]
        Gt = tl.sum(tl.load(slots + pp * (ROWS * SL) + rows[None, :, None] * SL + k2, mask=pm, other=0.0,
                            cache_modifier=".cg"), axis=0)
        Gt = tl.reshape(Gt, [ROWS, S_PAD, S_PAD])
        kd = S_PAD * S_PAD + tl.arange(0, S_PAD)[None, None, :]
        dt = tl.sum(tl.load(slots + pp * (ROWS * SL) + rows[None, :, None] * SL + kd, mask=pm, other=0.0,
                            cache_modifier=".cg"), axis=0)                       # [ROWS, S_PAD]
        if NB > 0:
            q = tl.sum(tl.where(si == sj, Gt, 0.0), axis=2)   # diagonal
            logit = dt * (1.0 / tl.sqrt(q / N + eps))
            logit = tl.where(tl.arange(0, S_PAD)[None, :] <= NB, logit, float("-inf"))
            e = tl.exp(logit - tl.max(logit, axis=1)[:, None])
            p = e / tl.sum(e, axis=1)[:, None]                                   # [ROWS, S_PAD]
            mixed = tl.sum(p[:, :, None] * X, axis=1)
            if not RND & 4:
                mixed = mixed.to(DTYPE).to(tl.float32)
            msq = tl.sum(tl.sum(p[:, :, None] * p[:, None, :] * Gt, axis=2), axis=1) / N
        else:
            mixed = y
            msq = tl.sum(tl.sum(Gt, axis=2), axis=1) / N
        out = mixed * (1.0 / tl.sqrt(msq + eps))[:, None]
        if RND & 1:
            out = out.to(DTYPE).to(tl.float32)
        out = out * gw[None, :]
        tl.store(nrm + off2, out.to(DTYPE), mask=mask2)


@triton.jit
def latent_tail_cols_kernel(
    y, w, ptrs, pads, epoch, HALF, g, ln, sp, out, bar, slots,
    M, N, SP, eps,
    TOPK: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
    ROWS: tl.constexpr, W: tl.constexpr, WSP: tl.constexpr, P_PAD: tl.constexpr,
    DTYPE: tl.constexpr, SEQ: tl.constexpr, VEC: tl.constexpr, PHASE: tl.constexpr,
    GEN: tl.constexpr = 32, SYNC: tl.constexpr = True, RND: tl.constexpr = 0,
):
    """triton_comm.latent_tail_kernel's outputs (ln = RMSNorm(all_reduce(sum_k w_k y_k), g); out = sp)
    with the columns split over the programs: W latent columns and WSP shared-partial columns each."""
    pid = tl.program_id(0)
    npid = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = pid * W + tl.arange(0, W)
    rm = rows < M
    mask2 = rm[:, None] & (cols < N)[None, :]
    off2 = rows[:, None] * N + cols[None, :]
    base = _half(epoch, HALF, WORLD)
    gw = tl.load(g + cols, mask=cols < N, other=0.0).to(tl.float32)
    if PHASE != 2:
        acc = tl.zeros([ROWS, W], tl.float32)
        for k in tl.static_range(TOPK):
            wk = tl.load(w + rows * TOPK + k, mask=rm, other=0.0).to(tl.float32)
            acc += wk[:, None] * tl.load(y + (rows[:, None] * TOPK + k) * N + cols[None, :], mask=mask2,
                                         other=0.0).to(tl.float32)
        if WORLD > 1:
            mine = tl.load(ptrs + RANK).to(tl.pointer_type(DTYPE)) + base
            tl.store(mine + off2, acc.to(DTYPE), mask=mask2)
            _signal(pads, pid, epoch, RANK, WORLD, SEQ, VEC)
        c2 = pid * WSP + tl.arange(0, WSP)             # this program's columns of the shared partial
        m2 = rm[:, None] & (c2 < SP)[None, :]
        o2 = rows[:, None] * SP + c2[None, :]
        tl.store(out + o2, tl.load(sp + o2, mask=m2, other=0.0), mask=m2)
        if WORLD > 1:
            _wait(pads, pid, epoch, RANK, WORLD, SEQ, VEC)
            acc = _sum_peers(ptrs, base, ptrs, off2, mask2, WORLD, DTYPE)
            _epoch_end(epoch)
        r = acc.to(DTYPE).to(tl.float32)
        tl.store(slots + pid * ROWS + rows, tl.sum(r * r, axis=1))
        if PHASE == 1:
            tl.store(ln + off2, r.to(DTYPE), mask=mask2)   # the rounded row, re-read by PHASE 2
    else:
        r = tl.load(ln + off2, mask=mask2, other=0.0).to(tl.float32)
    if PHASE == 0 and SYNC:   # SYNC=0: bench/cols_probe.py only (the partials then race)
        _grid_barrier(bar, GEN)
    if PHASE != 1:
        pp = tl.arange(0, P_PAD)[:, None]
        ss = tl.sum(tl.load(slots + pp * ROWS + rows[None, :], mask=pp < npid, other=0.0, cache_modifier=".cg"),
                    axis=0)
        y = r * (1.0 / tl.sqrt(ss / N + eps))[:, None]
        if RND & 1:
            y = y.to(DTYPE).to(tl.float32)
        tl.store(ln + off2, (y * gw[None, :]).to(DTYPE), mask=mask2)
