"""Triton kernels for the communication tails of the fused `k3::` ops (one-shot, P2P over NVLink).

Every kernel copies this rank's partial into its symmetric buffer, meets the peers at one
per-program barrier on the signal pads (`pads`: program p on this rank signals program p on
every peer, then waits for all of them), then reads each rank's partial from that rank's buffer
(`ptrs`, a device table of addresses). Two barrier protocols (`SEQ`):
  SEQ=1 (default): the signal is a posted release-exchange of the call's sequence number into the
        peer's slot, the wait spins on this rank's own slot until it holds at least that number
        (int32 difference, so it wraps). One one-way NVLink trip; a peer at most one call ahead
        (it cannot pass the next barrier without this rank's next signal) still satisfies `>=`.
  SEQ=0: a self-resetting handshake, signal = CAS 0->1 on the peer (a round trip, retried until
        the peer consumed the last signal), wait = CAS 1->0 locally.
The buffer has two halves; `epoch` (device int32 [3] in the workspace: half, arrivals, sequence)
says which one this call uses, and the last program to finish flips it and counts the call. A peer
therefore writes the other half in its next call, and can come back to this half only after
this rank has reached that next call's barrier, i.e. has finished reading: no closing barrier
is needed. Everything lives in device memory, so the kernels replay under CUDA graphs (every
rank runs the same sequence of communication kernels, so the epochs stay in step).
With WORLD == 1 there is no barrier and no buffer: `local` is read directly.

The same kernels run on CPU under TRITON_INTERPRET=1 with simulated peers (tests/test_kernels.py).
Rounding follows the references: the all-reduce result is rounded to the model dtype, the
residual add is done in fp32 and rounded, the norms in fp32. RND (constexpr) is the model's rounding
order where it differs from the reference model's (kernels/comm.py's rnd_bits from the ops' rounding arguments):
RND & 1, the post-norm's normalised row is rounded to the model dtype before its weight multiply
(transformers' `weight * h.to(dtype)`); RND & 2, the AttnRes keys (RMS-normed sources) stay fp32 in
the logits instead of being rounded to the model dtype; RND & 4, the mixed AttnRes row goes into the
output norm in fp32 (vLLM's AttnRes kernel) instead of being rounded to the model dtype first.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _signal(pads, slot0, epoch, RANK: tl.constexpr, WORLD: tl.constexpr, SEQ: tl.constexpr,
            VEC: tl.constexpr = True):
    """This program's half of the barrier: tell program slot0 of every peer that this program's
    stores so far are visible (slots slot0*WORLD .. +WORLD). VEC (SEQ barrier, WORLD <= 8): one
    vector atomic with a lane per peer, so the peers' signals (and their system-scope release
    fences) go out in one instruction instead of one after another."""
    tl.debug_barrier()  # this program's earlier stores happen before its signal
    if SEQ:
        seq = tl.load(epoch + 2) + 1  # this call's number (the last program adds 1 at the end)
        if VEC and WORLD <= 8:
            p = tl.arange(0, 8)
            on = (p < WORLD) & (p != RANK)
            peer = tl.load(pads + p, mask=on, other=0).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer + slot0 * WORLD + RANK, tl.zeros([8], tl.int32) + seq, mask=on, sem="release",
                           scope="sys")
        else:
            for p in tl.static_range(WORLD):
                if p != RANK:
                    peer = tl.load(pads + p).to(tl.pointer_type(tl.int32))
                    tl.atomic_xchg(peer + slot0 * WORLD + RANK, seq, sem="release", scope="sys")
    else:
        for p in tl.static_range(WORLD):
            if p != RANK:
                peer = tl.load(pads + p).to(tl.pointer_type(tl.uint32))
                while tl.atomic_cas(peer + slot0 * WORLD + RANK, 0, 1, sem="release", scope="sys") != 0:
                    pass


@triton.jit
def _wait(pads, slot0, epoch, RANK: tl.constexpr, WORLD: tl.constexpr, SEQ: tl.constexpr, VEC: tl.constexpr = True):
    """The other half: wait until program slot0 of every peer has signalled this call. Work that
    needs no peer data may run between _signal and _wait (it overlaps the NVLink trip). VEC: every
    peer's slot polled by one vector atomic (a lane per peer) instead of one slot after another."""
    mine = tl.load(pads + RANK)
    if SEQ:
        seq = tl.load(epoch + 2) + 1
        m32 = mine.to(tl.pointer_type(tl.int32))
        if VEC and WORLD <= 8:
            p = tl.arange(0, 8)
            on = (p < WORLD) & (p != RANK)
            ready = 0
            while ready == 0:
                f = tl.atomic_add(m32 + slot0 * WORLD + p, 0, mask=on, sem="acquire", scope="sys")
                ready = (tl.min(tl.where(on, f - seq, 0), axis=0) >= 0).to(tl.int32)
        else:
            for p in tl.static_range(WORLD):
                if p != RANK:
                    while tl.atomic_add(m32 + slot0 * WORLD + p, 0, sem="acquire", scope="sys") - seq < 0:
                        pass
    else:
        mu = mine.to(tl.pointer_type(tl.uint32))
        for p in tl.static_range(WORLD):
            if p != RANK:
                while tl.atomic_cas(mu + slot0 * WORLD + p, 1, 0, sem="acquire", scope="sys") != 1:
                    pass
    tl.debug_barrier()


@triton.jit
def _barrier(pads, slot0, epoch, RANK: tl.constexpr, WORLD: tl.constexpr, SEQ: tl.constexpr, VEC: tl.constexpr = True):
    """All programs with the same id on every rank meet here (slots slot0*WORLD .. +WORLD)."""
    _signal(pads, slot0, epoch, RANK, WORLD, SEQ, VEC)
    _wait(pads, slot0, epoch, RANK, WORLD, SEQ, VEC)


@triton.jit
def _epoch_end(epoch):
    """The last program of this kernel to get here flips the buffer half for the next call and
    counts the call (the SEQ barrier's sequence number)."""
    tl.debug_barrier()
    done = tl.atomic_add(epoch + 1, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(epoch + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(epoch + 2, 1, sem="relaxed", scope="gpu")
        tl.atomic_xor(epoch, 1, sem="release", scope="gpu")


@triton.jit
def _sum_peers(ptrs, base, local, off, mask, WORLD: tl.constexpr, DTYPE: tl.constexpr):
    """sum over ranks of buffer[base + off] (fp32), each read in the model dtype.
    WORLD == 1 reads `local + off` (no address table)."""
    if WORLD == 1:
        acc = tl.load(local + off, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros(off.shape, tl.float32)
        for p in tl.static_range(WORLD):
            src = tl.load(ptrs + p).to(tl.pointer_type(DTYPE)) + base
            acc += tl.load(src + off, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _wait_pushed(flags, epoch, NT, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Wait until every peer's push GEMM (cute/skinny_gemm.SkinnyGemmPushSm90) has published all
    NT column tiles of this call into this rank's buffer: flags[src * 128 + t] >= the call's
    sequence number (int32 difference, so it wraps), read with system-scope acquire."""
    seq = tl.load(epoch + 2) + 1
    t = tl.arange(0, 128)
    for p in tl.static_range(WORLD):
        if p != RANK:
            ready = 0
            while ready == 0:
                f = tl.atomic_add(flags + p * 128 + t, 0, mask=t < NT, sem="acquire", scope="sys")
                ready = (tl.min(tl.where(t < NT, f - seq, 0), axis=0) >= 0).to(tl.int32)
    tl.debug_barrier()


@triton.jit
def _sum_slots(mine, slot, off, mask, WORLD: tl.constexpr):
    """sum over source ranks of mine[p * slot + off] (fp32; the push layout: rank p's partial in
    slot p of this rank's own buffer), in rank order like _sum_peers."""
    acc = tl.zeros(off.shape, tl.float32)
    for p in tl.static_range(WORLD):
        acc += tl.load(mine + p * slot + off, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _rms(xf, mask, N, eps):
    """xf * rsqrt(mean(xf^2) + eps) over the valid lanes."""
    ms = tl.sum(tl.where(mask, xf * xf, 0.0), axis=0) / N
    return xf * (1.0 / tl.sqrt(ms + eps))


@triton.jit
def _key(y, DTYPE: tl.constexpr, RND: tl.constexpr):
    """An RMS-normed AttnRes source as its logit reads it: rounded to the model dtype, or (RND & 2) fp32."""
    if RND & 2:
        return y
    return y.to(DTYPE).to(tl.float32)


@triton.jit
def _post_norm(x, mask, N, eps, gw, DTYPE: tl.constexpr, RND: tl.constexpr):
    """RMSNorm(x) * gw in fp32, for one rounding to the model dtype at the store; with RND & 1 the
    normalised row is rounded first (the product of two model-dtype values is exact in fp32)."""
    y = _rms(x, mask, N, eps)
    if RND & 1:
        y = y.to(DTYPE).to(tl.float32)
    return y * gw


@triton.jit
def _mixed_row(x, DTYPE: tl.constexpr, RND: tl.constexpr = 0):
    """The mixed AttnRes row as the output norm reads it: rounded to the model dtype, or (RND & 4) fp32."""
    if RND & 4:
        return x
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _mix_source(src, mask, wmix, N, eps, m, s, acc, DTYPE: tl.constexpr, RND: tl.constexpr = 0):
    """One AttnRes source into the running (max, sum, weighted acc) of an online softmax."""
    logit = tl.sum(tl.where(mask, _key(_rms(src, mask, N, eps), DTYPE, RND) * wmix, 0.0), axis=0)
    m_new = tl.maximum(m, logit)
    scale = tl.exp(m - m_new)
    e = tl.exp(logit - m_new)
    return m_new, s * scale + e, acc * scale + e * src


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _mix4(x0, x1, x2, x3, V0: tl.constexpr, V1: tl.constexpr, V2: tl.constexpr, V3: tl.constexpr, wmix, N, eps,
          m, s, acc, DTYPE: tl.constexpr, RND: tl.constexpr = 0):
    """Up to four AttnRes sources (those with V* set) into the softmax state (max, sum, weighted acc)
    at once: their sums of squares in one reduction, their logits in a second (one pass of the
    block's shared-memory exchange each, where _mix_source one after another takes two per source).
    The same per-source math as _mix_source (each RMS-normed row rounded to the model dtype, dotted with
    the query); the softmax sums in another order (the reference's torch.softmax is no online one
    either). Masked lanes must be zero in every x."""
    q0, q1, q2, q3 = tl.reduce((x0 * x0, x1 * x1, x2 * x2, x3 * x3), 0, _add4)
    l0, l1, l2, l3 = tl.reduce((_key(x0 * (1.0 / tl.sqrt(q0 / N + eps)), DTYPE, RND) * wmix,
                                _key(x1 * (1.0 / tl.sqrt(q1 / N + eps)), DTYPE, RND) * wmix,
                                _key(x2 * (1.0 / tl.sqrt(q2 / N + eps)), DTYPE, RND) * wmix,
                                _key(x3 * (1.0 / tl.sqrt(q3 / N + eps)), DTYPE, RND) * wmix), 0, _add4)
    ninf = float("-inf")
    if not V0:
        l0 = ninf
    if not V1:
        l1 = ninf
    if not V2:
        l2 = ninf
    if not V3:
        l3 = ninf
    m_new = tl.maximum(tl.maximum(m, tl.maximum(l0, l1)), tl.maximum(l2, l3))
    scale = tl.exp(m - m_new)
    e0 = tl.exp(l0 - m_new)
    e1 = tl.exp(l1 - m_new)
    e2 = tl.exp(l2 - m_new)
    e3 = tl.exp(l3 - m_new)
    return m_new, s * scale + ((e0 + e1) + (e2 + e3)), acc * scale + ((e0 * x0 + e1 * x1) + (e2 * x2 + e3 * x3))


@triton.jit
def _wmix(w_norm, w_qk, offs, mask):
    """The AttnRes query w_norm * w_qk in fp32 (each source's logit is its RMS-normed row . this)."""
    return tl.load(w_norm + offs, mask=mask, other=0.0).to(tl.float32) * \
        tl.load(w_qk + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _block_row(b, row, offs, mask, N):
    return tl.load(b + row * N + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _src_row(b, I: tl.constexpr, NB: tl.constexpr, row, offs, mask, N, BLOCK_N: tl.constexpr):
    """Block I's row (fp32), or zeros where there is no block I."""
    if I < NB:
        x = _block_row(b, row, offs, mask, N)
    else:
        x = tl.zeros([BLOCK_N], tl.float32)
    return x


@triton.jit
def _half(epoch, HALF, WORLD: tl.constexpr):
    """Element offset of the buffer half this call uses."""
    h = tl.zeros((), tl.int64)
    if WORLD > 1:
        h = tl.load(epoch).to(tl.int64) * HALF
    return h


@triton.jit
def _ar_pre(res, b0, b1, b2, b3, b4, b5, b6, b7, row, offs, mask, wmix, w_norm, w_qk, N, eps, NB: tl.constexpr,
            HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
            PRELOAD: tl.constexpr = True, LEAN: tl.constexpr = True, JOINT: tl.constexpr = False,
            RND: tl.constexpr = 0):
    """What a row needs that no peer provides: its residual and the AttnRes blocks' online-softmax
    state (running max, sum, weighted sum). Done before the barrier wait for a program's first row.
    PRELOAD: the first four block rows are loaded before the first of them is reduced (one memory
    latency instead of one per block: 0.2-2.1 us per call at decode, where one program holds the
    whole row; the chain of reductions is most of the rest); the same values, bit for bit.
    LEAN (ar_residual_norm_kernel): the residual is returned in the model dtype and the AttnRes query
    is loaded here (not held by the caller): fewer registers live across the barrier wait.
    JOINT: the blocks four at a time through _mix4 (two reductions per four blocks, not two per block)."""
    if LEAN:
        r = tl.zeros([BLOCK_N], DTYPE)
        if HAS_RES:
            r = tl.load(res + row * N + offs, mask=mask, other=0.0)
        if HAS_NORM and NB > 0:
            wmix = _wmix(w_norm, w_qk, offs, mask)
    else:
        r = tl.zeros([BLOCK_N], tl.float32)
        if HAS_RES:
            r = tl.load(res + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    acc = tl.zeros([BLOCK_N], tl.float32)
    if HAS_NORM and JOINT and NB > 0:
        m, s, acc = _mix4(_src_row(b0, 0, NB, row, offs, mask, N, BLOCK_N), _src_row(b1, 1, NB, row, offs, mask, N, BLOCK_N),
                          _src_row(b2, 2, NB, row, offs, mask, N, BLOCK_N), _src_row(b3, 3, NB, row, offs, mask, N, BLOCK_N),
                          NB > 0, NB > 1, NB > 2, NB > 3, wmix, N, eps, m, s, acc, DTYPE, RND)
        if NB > 4:
            m, s, acc = _mix4(_src_row(b4, 4, NB, row, offs, mask, N, BLOCK_N),
                              _src_row(b5, 5, NB, row, offs, mask, N, BLOCK_N),
                              _src_row(b6, 6, NB, row, offs, mask, N, BLOCK_N),
                              _src_row(b7, 7, NB, row, offs, mask, N, BLOCK_N),
                              NB > 4, NB > 5, NB > 6, NB > 7, wmix, N, eps, m, s, acc, DTYPE, RND)
    elif HAS_NORM:
        x0 = tl.zeros([BLOCK_N], tl.float32)
        x1 = tl.zeros([BLOCK_N], tl.float32)
        x2 = tl.zeros([BLOCK_N], tl.float32)
        x3 = tl.zeros([BLOCK_N], tl.float32)
        if PRELOAD:
            if NB > 0:
                x0 = _block_row(b0, row, offs, mask, N)
            if NB > 1:
                x1 = _block_row(b1, row, offs, mask, N)
            if NB > 2:
                x2 = _block_row(b2, row, offs, mask, N)
            if NB > 3:
                x3 = _block_row(b3, row, offs, mask, N)
        if NB > 0:
            if not PRELOAD:
                x0 = _block_row(b0, row, offs, mask, N)
            m, s, acc = _mix_source(x0, mask, wmix, N, eps, m, s, acc, DTYPE, RND)
        if NB > 1:
            if not PRELOAD:
                x1 = _block_row(b1, row, offs, mask, N)
            m, s, acc = _mix_source(x1, mask, wmix, N, eps, m, s, acc, DTYPE, RND)
        if NB > 2:
            if not PRELOAD:
                x2 = _block_row(b2, row, offs, mask, N)
            m, s, acc = _mix_source(x2, mask, wmix, N, eps, m, s, acc, DTYPE, RND)
        if NB > 3:
            if not PRELOAD:
                x3 = _block_row(b3, row, offs, mask, N)
            m, s, acc = _mix_source(x3, mask, wmix, N, eps, m, s, acc, DTYPE, RND)
        if NB > 4:
            m, s, acc = _mix_source(_block_row(b4, row, offs, mask, N), mask, wmix, N, eps, m, s, acc, DTYPE,
                                    RND)
        if NB > 5:
            m, s, acc = _mix_source(_block_row(b5, row, offs, mask, N), mask, wmix, N, eps, m, s, acc, DTYPE,
                                    RND)
        if NB > 6:
            m, s, acc = _mix_source(_block_row(b6, row, offs, mask, N), mask, wmix, N, eps, m, s, acc, DTYPE,
                                    RND)
        if NB > 7:
            m, s, acc = _mix_source(_block_row(b7, row, offs, mask, N), mask, wmix, N, eps, m, s, acc, DTYPE,
                                    RND)
    return r, m, s, acc


@triton.jit
def _ar_post(y, r, m, s, acc, upd, nrm, row, offs, mask, gw, wmix, g, w_norm, w_qk, N, eps, NB: tl.constexpr,
             HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, DTYPE: tl.constexpr, LEAN: tl.constexpr = True,
             RND: tl.constexpr = 0):
    """The row's outputs from the all-reduced y and _ar_pre's state: upd = r + y, nrm = the post-norm
    (the updated row is the last AttnRes source). LEAN: g and the AttnRes query are loaded here."""
    if HAS_RES:
        y = (r.to(tl.float32) + y).to(DTYPE).to(tl.float32)
    if LEAN and HAS_NORM:
        gw = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
        if NB > 0:
            wmix = _wmix(w_norm, w_qk, offs, mask)
    tl.store(upd + row * N + offs, y.to(DTYPE), mask=mask)
    if HAS_NORM:
        mixed = y
        if NB > 0:
            m, s, acc = _mix_source(y, mask, wmix, N, eps, m, s, acc, DTYPE, RND)
            mixed = _mixed_row(acc / s, DTYPE, RND)
        out = _post_norm(mixed, mask, N, eps, gw, DTYPE, RND)
        tl.store(nrm + row * N + offs, out.to(DTYPE), mask=mask)


@triton.jit
def _ar_row_sum(ptrs, base, local, mine, row, M, N, offs, mask, WORLD: tl.constexpr, DTYPE: tl.constexpr,
                PUSHED: tl.constexpr):
    """The all-reduced row, rounded to the model dtype, in fp32."""
    if PUSHED and WORLD > 1:
        y = _sum_slots(mine, M * N, row * N + offs, mask, WORLD)
    else:
        y = _sum_peers(ptrs, base, local, row * N + offs, mask, WORLD, DTYPE)
    return y.to(DTYPE).to(tl.float32)


@triton.jit
def _ar_wait(ptrs, pads, epoch, FLAG_OFF, NT, pid, RANK: tl.constexpr, WORLD: tl.constexpr, SEQ: tl.constexpr,
             PUSHED: tl.constexpr, VEC: tl.constexpr):
    """Until every peer's partial of this program's rows is readable: the push GEMM's flags, or the
    barrier's wait."""
    if PUSHED:
        flags = (tl.load(ptrs + RANK) + FLAG_OFF).to(tl.pointer_type(tl.int32))
        _wait_pushed(flags, epoch, NT, RANK, WORLD)
    else:
        _wait(pads, pid, epoch, RANK, WORLD, SEQ, VEC)


@triton.jit
def _w1_sources(g, w_norm, w_qk, b0, b1, b2, b3, row, offs, mask, N, NB: tl.constexpr, HAS_NORM: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """_ar_row_w1's norm weight, AttnRes query and first four block rows (fp32; zeros where absent)."""
    gw = tl.zeros([BLOCK_N], tl.float32)
    wmix = tl.zeros([BLOCK_N], tl.float32)
    x0 = tl.zeros([BLOCK_N], tl.float32)
    x1 = tl.zeros([BLOCK_N], tl.float32)
    x2 = tl.zeros([BLOCK_N], tl.float32)
    x3 = tl.zeros([BLOCK_N], tl.float32)
    if HAS_NORM:
        gw = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
        if NB > 0:
            wmix = _wmix(w_norm, w_qk, offs, mask)
            x0 = _src_row(b0, 0, NB, row, offs, mask, N, BLOCK_N)
            x1 = _src_row(b1, 1, NB, row, offs, mask, N, BLOCK_N)
            x2 = _src_row(b2, 2, NB, row, offs, mask, N, BLOCK_N)
            x3 = _src_row(b3, 3, NB, row, offs, mask, N, BLOCK_N)
    return gw, wmix, x0, x1, x2, x3


@triton.jit
def _ar_row_w1(local, res, b0, b1, b2, b3, b4, b5, b6, b7, upd, nrm, g, w_norm, w_qk, row, offs, mask, N, eps,
               NB: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr,
               DTYPE: tl.constexpr, FIRST: tl.constexpr, RND: tl.constexpr = 0):
    """One row at WORLD == 1 with JOINT: the same outputs as _ar_pre + _ar_row_sum + _ar_post, but the
    updated row (no peers to wait for) joins the blocks' _mix4 groups: with up to 3 blocks, 3
    reductions in all (sums of squares, logits, the post-norm) instead of 2 * (NB + 1) + 1."""
    # FIRST: every load before the store of `upd` (the compiler may not move a load above a store it
    # cannot prove disjoint, so loads after it wait for a second round trip to memory)
    y = tl.load(local + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    if FIRST:
        gw, wmix, x0, x1, x2, x3 = _w1_sources(g, w_norm, w_qk, b0, b1, b2, b3, row, offs, mask, N, NB, HAS_NORM,
                                               BLOCK_N)
    if HAS_RES:
        y = (r + y).to(DTYPE).to(tl.float32)
    tl.store(upd + row * N + offs, y.to(DTYPE), mask=mask)
    if not FIRST:
        gw, wmix, x0, x1, x2, x3 = _w1_sources(g, w_norm, w_qk, b0, b1, b2, b3, row, offs, mask, N, NB, HAS_NORM,
                                               BLOCK_N)
    if HAS_NORM:
        mixed = y
        if NB > 0:
            m = tl.full((), float("-inf"), tl.float32)
            s = tl.zeros((), tl.float32)
            acc = tl.zeros([BLOCK_N], tl.float32)
            if NB < 4:
                m, s, acc = _mix4(x0, x1, x2, y, NB > 0, NB > 1, NB > 2, True, wmix, N, eps, m, s, acc, DTYPE, RND)
            else:
                m, s, acc = _mix4(x0, x1, x2, x3, True, True, True, True, wmix, N, eps, m, s, acc, DTYPE, RND)
                if NB == 4 or NB == 8:
                    if NB == 8:
                        m, s, acc = _mix4(_block_row(b4, row, offs, mask, N), _block_row(b5, row, offs, mask, N),
                                          _block_row(b6, row, offs, mask, N), _block_row(b7, row, offs, mask, N),
                                          True, True, True, True, wmix, N, eps, m, s, acc, DTYPE, RND)
                    m, s, acc = _mix_source(y, mask, wmix, N, eps, m, s, acc, DTYPE, RND)
                else:
                    m, s, acc = _mix4(_src_row(b4, 4, NB, row, offs, mask, N, BLOCK_N),
                                      _src_row(b5, 5, NB, row, offs, mask, N, BLOCK_N),
                                      _src_row(b6, 6, NB, row, offs, mask, N, BLOCK_N), y,
                                      NB > 4, NB > 5, NB > 6, True, wmix, N, eps, m, s, acc, DTYPE, RND)
            mixed = _mixed_row(acc / s, DTYPE, RND)
        out = _post_norm(mixed, mask, N, eps, gw, DTYPE, RND)
        tl.store(nrm + row * N + offs, out.to(DTYPE), mask=mask)


@triton.jit
def ar_residual_norm_kernel(
    ptrs, pads, epoch, HALF, local, res, upd, nrm, g, w_norm, w_qk,
    b0, b1, b2, b3, b4, b5, b6, b7,
    M, N, eps, FLAG_OFF, NT,
    RANK: tl.constexpr, WORLD: tl.constexpr, NB: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, SEQ: tl.constexpr,
    PUSHED: tl.constexpr = False, EARLY: tl.constexpr = True, VEC: tl.constexpr = True,
    PRELOAD: tl.constexpr = True, LEAN: tl.constexpr = True, JOINT: tl.constexpr = True,
    W1_FIRST: tl.constexpr = True, TRIGGER: tl.constexpr = False, RND: tl.constexpr = 0,
):
    """upd = res + sum_ranks(local); nrm = AttnRes post-norm of upd over NB blocks (RMSNorm(g)
    when NB == 0). Without a residual (HAS_RES=0) it is a plain all-reduce into `upd`.
    `local` is this rank's [M, N] partial; rows are spread over the programs. EARLY: between its
    barrier signal and its wait a program reads its first row's residual and AttnRes blocks
    (_ar_pre); else after the wait.
    PUSHED (WORLD > 1): the push GEMM has already stored every rank's partial into this rank's
    buffer (slot p = rank p) and flagged them (int32 flags at byte FLAG_OFF of this rank's buffer,
    NT column tiles per rank): no copy, no barrier, no peer loads; `local` is unused.
    VEC: _signal / _wait. PRELOAD: _ar_pre. LEAN: g and the AttnRes query w_norm * w_qk are loaded where
    they are used (each row's _ar_pre and _ar_post) and the residual row is held in the model dtype,
    instead of three fp32 rows held for the whole kernel: at WORLD = 8 with AttnRes blocks those
    rows beside the 8 peer rows in flight spilled 3.2 KB per thread (ptxas, sm_90a, 8 warps).
    JOINT: the AttnRes blocks' reductions four blocks at a time (_mix4); at WORLD == 1 the updated row
    joins them (_ar_row_w1), which with W1_FIRST issues every load before its store of `upd`.
    TRIGGER (CUDA): the kernel after this one, if launched with PDL, may launch at once
    (gdc_launch_dependents first: it waits for this kernel's completion before it reads the outputs,
    and streams its weights meanwhile; gemm.gemv_pdl; set where the op's `trigger` is, pair_pdl). RND: the
    rounding order (module docstring)."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    npid = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    if WORLD == 1 and JOINT:
        for row in range(pid, M, npid):
            _ar_row_w1(local, res, b0, b1, b2, b3, b4, b5, b6, b7, upd, nrm, g, w_norm, w_qk, row, offs, mask, N, eps,
                       NB, HAS_NORM, HAS_RES, BLOCK_N, DTYPE, W1_FIRST, RND)
    else:
        _ar_rows(ptrs, pads, epoch, HALF, local, res, upd, nrm, g, w_norm, w_qk, b0, b1, b2, b3, b4, b5, b6, b7,
                 M, N, eps, FLAG_OFF, NT, pid, npid, offs, mask, RANK, WORLD, NB, HAS_NORM, HAS_RES, BLOCK_N, DTYPE,
                 SEQ, PUSHED, EARLY, VEC, PRELOAD, LEAN, JOINT, RND)


@triton.jit
def _ar_rows(ptrs, pads, epoch, HALF, local, res, upd, nrm, g, w_norm, w_qk, b0, b1, b2, b3, b4, b5, b6, b7,
             M, N, eps, FLAG_OFF, NT, pid, npid, offs, mask, RANK: tl.constexpr, WORLD: tl.constexpr,
             NB: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr,
             DTYPE: tl.constexpr, SEQ: tl.constexpr, PUSHED: tl.constexpr, EARLY: tl.constexpr, VEC: tl.constexpr,
             PRELOAD: tl.constexpr, LEAN: tl.constexpr, JOINT: tl.constexpr, RND: tl.constexpr = 0):
    """ar_residual_norm_kernel's program: copy + barrier (WORLD > 1), then its rows."""
    gw = tl.zeros([BLOCK_N], tl.float32)
    wmix = tl.zeros([BLOCK_N], tl.float32)
    if HAS_NORM and not LEAN:
        gw = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
        if NB > 0:
            wmix = _wmix(w_norm, w_qk, offs, mask)
    base = _half(epoch, HALF, WORLD)
    mine = local
    if WORLD > 1:
        mine = tl.load(ptrs + RANK).to(tl.pointer_type(DTYPE)) + base
        if not PUSHED:
            for row in range(pid, M, npid):
                tl.store(mine + row * N + offs, tl.load(local + row * N + offs, mask=mask), mask=mask)
            _signal(pads, pid, epoch, RANK, WORLD, SEQ, VEC)
    if WORLD > 1 and not EARLY:
        _ar_wait(ptrs, pads, epoch, FLAG_OFF, NT, pid, RANK, WORLD, SEQ, PUSHED, VEC)
    m0 = offs < tl.where(pid < M, N, 0)   # a program beyond M (M == 0) touches nothing
    r, m, s, acc = _ar_pre(res, b0, b1, b2, b3, b4, b5, b6, b7, pid, offs, m0, wmix, w_norm, w_qk, N, eps, NB,
                           HAS_NORM, HAS_RES, BLOCK_N, DTYPE, PRELOAD, LEAN, JOINT, RND)
    if WORLD > 1 and EARLY:
        _ar_wait(ptrs, pads, epoch, FLAG_OFF, NT, pid, RANK, WORLD, SEQ, PUSHED, VEC)
    y = _ar_row_sum(ptrs, base, local, mine, pid, M, N, offs, m0, WORLD, DTYPE, PUSHED)
    _ar_post(y, r, m, s, acc, upd, nrm, pid, offs, m0, gw, wmix, g, w_norm, w_qk, N, eps, NB, HAS_NORM, HAS_RES,
             DTYPE, LEAN, RND)
    for row in range(pid + npid, M, npid):
        r, m, s, acc = _ar_pre(res, b0, b1, b2, b3, b4, b5, b6, b7, row, offs, mask, wmix, w_norm, w_qk, N, eps, NB,
                               HAS_NORM, HAS_RES, BLOCK_N, DTYPE, PRELOAD, LEAN, JOINT, RND)
        y = _ar_row_sum(ptrs, base, local, mine, row, M, N, offs, mask, WORLD, DTYPE, PUSHED)
        _ar_post(y, r, m, s, acc, upd, nrm, row, offs, mask, gw, wmix, g, w_norm, w_qk, N, eps, NB, HAS_NORM, HAS_RES,
                 DTYPE, LEAN, RND)
    if WORLD > 1:
        _epoch_end(epoch)


@triton.jit
def latent_tail_kernel(
    y, w, ptrs, pads, epoch, HALF, g, ln, sp, out,
    M, N, SP, eps,
    TOPK: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SP: tl.constexpr, DTYPE: tl.constexpr, SEQ: tl.constexpr,
    EARLY: tl.constexpr = True, VEC: tl.constexpr = True, RND: tl.constexpr = 0,
):
    """Finalize + all-reduce + RMSNorm of the latent, and a copy of the shared partial:
    mine[row] = sum_k w[row, k] * y[row, k] (fp32, rounded); ln = RMSNorm(sum_ranks mine, g);
    out = sp (the up-projection GEMM then adds into this rank's columns of out).
    EARLY: the shared partial is copied between the barrier's signal and its wait (else before the
    signal). VEC: _signal / _wait. WORLD == 1: each row is normed from registers (no peers: nothing
    goes through memory between the finalize and the norm), and ptrs / pads / epoch are unread.
    RND & 1: the norm's rounding order (module docstring)."""
    pid = tl.program_id(0)
    npid = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    if WORLD == 1:
        gw1 = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
        for row in range(pid, M, npid):
            acc1 = tl.zeros([BLOCK_N], tl.float32)
            for k in tl.static_range(TOPK):
                wk = tl.load(w + row * TOPK + k).to(tl.float32)
                acc1 += wk * tl.load(y + (row * TOPK + k) * N + offs, mask=mask, other=0.0).to(tl.float32)
            for c in tl.static_range(0, BLOCK_SP, 1024):
                o2 = c + tl.arange(0, 1024)
                m2 = o2 < SP
                tl.store(out + row * SP + o2, tl.load(sp + row * SP + o2, mask=m2, other=0.0), mask=m2)
            r1 = acc1.to(DTYPE).to(tl.float32)
            tl.store(ln + row * N + offs, _post_norm(r1, mask, N, eps, gw1, DTYPE, RND).to(DTYPE), mask=mask)
    else:
        _tail_rows(y, w, ptrs, pads, epoch, HALF, g, ln, sp, out, M, N, SP, eps, pid, npid, offs, mask, TOPK, RANK,
                   WORLD, BLOCK_N, BLOCK_SP, DTYPE, SEQ, EARLY, VEC, RND)


@triton.jit
def _tail_rows(y, w, ptrs, pads, epoch, HALF, g, ln, sp, out, M, N, SP, eps, pid, npid, offs, mask,
               TOPK: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_SP: tl.constexpr, DTYPE: tl.constexpr, SEQ: tl.constexpr, EARLY: tl.constexpr,
               VEC: tl.constexpr, RND: tl.constexpr = 0):
    """latent_tail_kernel's program at WORLD > 1."""
    base = _half(epoch, HALF, WORLD)
    mine = tl.load(ptrs + RANK).to(tl.pointer_type(DTYPE)) + base
    for row in range(pid, M, npid):
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k in tl.static_range(TOPK):
            wk = tl.load(w + row * TOPK + k).to(tl.float32)
            acc += wk * tl.load(y + (row * TOPK + k) * N + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(mine + row * N + offs, acc.to(DTYPE), mask=mask)
    if EARLY:
        _signal(pads, pid, epoch, RANK, WORLD, SEQ, VEC)
    for row in range(pid, M, npid):
        for c in tl.static_range(0, BLOCK_SP, 1024):  # the shared partial's row, copied
            o2 = c + tl.arange(0, 1024)
            m2 = o2 < SP
            tl.store(out + row * SP + o2, tl.load(sp + row * SP + o2, mask=m2, other=0.0), mask=m2)
    if not EARLY:
        _signal(pads, pid, epoch, RANK, WORLD, SEQ, VEC)
    _wait(pads, pid, epoch, RANK, WORLD, SEQ, VEC)
    gw = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, M, npid):
        r = _sum_peers(ptrs, base, ptrs, row * N + offs, mask, WORLD, DTYPE).to(DTYPE).to(tl.float32)
        tl.store(ln + row * N + offs, _post_norm(r, mask, N, eps, gw, DTYPE, RND).to(DTYPE), mask=mask)
    _epoch_end(epoch)


@triton.jit
def gather_router_latent_kernel(
    ptrs, pads, epoch, HALF, shard, router, latent, M, S, E, L,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr, SEQ: tl.constexpr,
    VEC: tl.constexpr = True,
):
    """All-gather of the sharded [W_r; W_down] projection. `shard` is this rank's [M, S] result,
    row-major (rank p holds columns [p*S, (p+1)*S) of [router | latent]). Writes router [M, E] and
    latent [M, L]."""
    pid = tl.program_id(0)
    npid = tl.num_programs(0)
    base = _half(epoch, HALF, WORLD)
    mine = tl.load(ptrs + RANK).to(tl.pointer_type(DTYPE)) + base
    for start in range(pid * BLOCK, M * S, npid * BLOCK):
        i = start + tl.arange(0, BLOCK)
        tl.store(mine + i, tl.load(shard + i, mask=i < M * S), mask=i < M * S)
    _barrier(pads, pid, epoch, RANK, WORLD, SEQ, VEC)
    total = M * (E + L)
    for start in range(pid * BLOCK, total, npid * BLOCK):
        i = start + tl.arange(0, BLOCK)
        valid = i < total
        row = i // (E + L)
        c = i % (E + L)
        p = c // S
        off = row * S + c % S
        src = tl.load(ptrs + p, mask=valid, other=0).to(tl.pointer_type(DTYPE)) + base
        v = tl.load(src + off, mask=valid, other=0.0)
        tl.store(router + row * E + c, v, mask=valid & (c < E))
        tl.store(latent + row * L + (c - E), v, mask=valid & (c >= E))
    _epoch_end(epoch)


@triton.jit
def l2_prefetch_kernel(base, nbytes, LANES: tl.constexpr):
    """Pull [base, base + nbytes) into L2: each lane issues one 4 KiB bulk prefetch (Hopper
    `cp.async.bulk.prefetch.L2`); lanes past the end re-prefetch the first chunk, and a last
    partial chunk (< 4 KiB) is left out."""
    pid = tl.program_id(0)
    off = (pid * LANES + tl.arange(0, LANES)).to(tl.int64) * 4096
    off = tl.where(off + 4096 <= nbytes, off, 0)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 4096; mov.u32 $0, 0;",
                              "=r,l", [base + off], dtype=tl.int32, is_pure=False, pack=1)
