"""Triton MLA decode attention over the latent KV cache (the `k3model::mla_decode` op's CUDA path).

The op's reference (model/attention_ops.mla_core) writes the new token's latent + rope key into
the cache, then attends in fp32 over the whole cache slice it needs: it casts the slice to fp32,
zeroes the slots past each sequence, and runs two batched GEMMs and a softmax on them. On an H200
that is most of an MLA layer's attention time at decode (one MLA step at TP=8 widths, context 1024:
the cache copies, the masked fill, the fp32 bmm's and the softmax, about 40 us of kernels for a
1.2 MB cache row; bench/layer_bench.py --attribute, BENCHMARKS.md).

Here (flash-decoding): `mla_split_kernel`, grid (M, head blocks of BH, splits of the cache), writes
the new token's row into the cache (one program) and takes it from kv_new everywhere else, reads
each [BS, L + R] cache tile once for BH heads (the latent cache is shared by every head), computes
scores = (q_lat . c + q_rope . k_rope) * scale on the tensor cores with fp32 accumulation, keeps an
online softmax (running max, sum) and o = p @ c for its split, and stores them; `mla_combine_kernel`,
grid (M, H), rescales the splits' partials to one max and writes o in the query dtype. Positions
past a sequence (s > seq_lens[m]) are never read: their scores are -inf and their values masked to
0, as the reference does. A split past the sequence stores an empty partial (max -inf, sum 0).
The softmax weights are rounded to the cache dtype for the p @ c product (as flash attention does);
the reference keeps them in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_split_kernel(q_lat, q_rope, kv_new, cache, lens, part_o, part_ml, H, S, CH, NS, scale,
                     sqm, sqh, srm, srh, snm, scm, scs, kv_w, eps,
                     L: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr,
                     IEEE: tl.constexpr, NORM: tl.constexpr = False, NORM_CF: tl.constexpr = False):
    """Program (m, hb, sp): heads [hb*BH, +BH) of row m over cache positions [sp*CH, +CH) that are
    <= seq_lens[m]. part_o [M, H, NS, L] fp32, part_ml [M, H, NS, 2] fp32 (max, sum).
    The new token's row kv_new[m] (at position seq_lens[m]) is taken from kv_new, not from the cache,
    and the program of head block 0 whose split holds that position writes it into the cache (no
    separate scatter kernel; no program reads that cache row). NORM: kv_new holds the raw kv_a row
    and its latent part is RMS-normalised here (fp32, x * rsqrt(mean(x^2) + eps) * kv_w, rounded to
    the cache dtype: the model's rms_norm; NORM_CF: x * rsqrt(...) rounded to the cache dtype before
    the weight, the product rounded again), its rope part taken as it is."""
    m = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(lens + m).to(tl.int32) + 1              # positions 0 .. seq_lens[m] (the new token)
    newp = n - 1
    s0 = sp * CH
    s_end = tl.minimum(s0 + CH, tl.minimum(n, S))
    row = cache + m * scm
    h = hb * BH + tl.arange(0, BH)
    hm = h < H
    ol = tl.arange(0, L)
    orr = tl.arange(0, R)
    dt = cache.dtype.element_ty
    ql = tl.load(q_lat + m * sqm + h[:, None] * sqh + ol[None, :], mask=hm[:, None], other=0.0).to(dt)
    qr = tl.load(q_rope + m * srm + h[:, None] * srh + orr[None, :], mask=hm[:, None], other=0.0).to(dt)
    if NORM:
        xf = tl.load(kv_new + m * snm + ol).to(tl.float32)
        xr = xf * tl.math.rsqrt(tl.sum(xf * xf, axis=0) / L + eps)
        if NORM_CF:
            xr = xr.to(dt).to(tl.float32)
        cn = (xr * tl.load(kv_w + ol).to(tl.float32)).to(dt)
    else:
        cn = tl.load(kv_new + m * snm + ol).to(dt)
    krn = tl.load(kv_new + m * snm + L + orr).to(dt)
    mi = tl.full([BH], float("-inf"), tl.float32)
    li = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, L], tl.float32)
    _store_new_row(row, hb, newp, s0, CH, S, scs, cn, krn, L, R)
    for s in range(s0, s_end, BS):
        os_ = s + tl.arange(0, BS)
        sm = os_ < s_end
        isnew = os_ == newp
        c, kr = _cache_tile(row, s, s_end, newp, scs, L, R, BS)
        c = tl.where(isnew[:, None], cn[None, :], c)
        kr = tl.where(isnew[:, None], krn[None, :], kr)
        if IEEE:
            sc = tl.dot(ql, tl.trans(c), input_precision="ieee") + tl.dot(qr, tl.trans(kr), input_precision="ieee")
        else:
            sc = tl.dot(ql, tl.trans(c)) + tl.dot(qr, tl.trans(kr))
        sc = tl.where(sm[None, :], sc * scale, float("-inf"))
        mnew = tl.maximum(mi, tl.max(sc, axis=1))      # finite: the tile's first position is < s_end
        alpha = tl.exp(mi - mnew)
        p = tl.exp(sc - mnew[:, None])
        li = li * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(dt), c, input_precision="ieee")
        else:
            pv = tl.dot(p.to(dt), c)
        acc = acc * alpha[:, None] + pv
        mi = mnew
    base = (m * H + h) * NS + sp
    tl.store(part_o + base[:, None] * L + ol[None, :], acc, mask=hm[:, None])
    tl.store(part_ml + base * 2, mi, mask=hm)
    tl.store(part_ml + base * 2 + 1, li, mask=hm)


@triton.jit
def _store_new_row(row, hb, newp, s0, CH, S, scs, cn, krn, L: tl.constexpr, R: tl.constexpr):
    """The new token's latent and rope key into its cache row, by the head-block-0 program whose split
    holds that position."""
    if (hb == 0) & (newp >= s0) & (newp < s0 + CH) & (newp < S):
        tl.store(row + newp.to(tl.int64) * scs + tl.arange(0, L), cn)
        tl.store(row + newp.to(tl.int64) * scs + L + tl.arange(0, R), krn)


@triton.jit
def _cache_tile(row, s, s_end, newp, scs, L: tl.constexpr, R: tl.constexpr, BS: tl.constexpr):
    """The latent and rope parts of cache positions [s, s + BS) below s_end, the new token's (newp)
    and those past s_end read as 0."""
    os_ = s + tl.arange(0, BS)
    rd = (os_ < s_end) & (os_ != newp)
    c = tl.load(row + os_[:, None] * scs + tl.arange(0, L)[None, :], mask=rd[:, None], other=0.0)
    kr = tl.load(row + os_[:, None] * scs + L + tl.arange(0, R)[None, :], mask=rd[:, None], other=0.0)
    return c, kr


@triton.jit
def _combine_splits(part_o, part_ml, base, NS, ol, L: tl.constexpr, W: tl.constexpr, BNS: tl.constexpr):
    """o[ol] = sum_i exp(max_i - max) o_i[ol] / sum_i exp(max_i - max) sum_i over the NS splits from
    row `base` of the partials (empty splits, max -inf, weigh 0); fp32 [W] (W = the size of ol)."""
    gm = tl.full([BNS], float("-inf"), tl.float32)
    for i in range(0, NS, BNS):
        k = i + tl.arange(0, BNS)
        gm = tl.maximum(gm, tl.load(part_ml + (base + k) * 2, mask=k < NS, other=float("-inf")))
    top = tl.max(gm, axis=0)
    den = tl.zeros([BNS], tl.float32)
    acc = tl.zeros([W], tl.float32)
    for i in range(0, NS, BNS):
        k = i + tl.arange(0, BNS)
        km = k < NS
        mk = tl.load(part_ml + (base + k) * 2, mask=km, other=float("-inf"))
        w = tl.where(mk > float("-inf"), tl.exp(mk - top), 0.0)
        den += w * tl.load(part_ml + (base + k) * 2 + 1, mask=km, other=0.0)
        o = tl.load(part_o + (base + k)[:, None] * L + ol[None, :], mask=km[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
    return acc / tl.sum(den, axis=0)


@triton.jit
def _combine_splits_flat(part_o, part_ml, base, ol, L: tl.constexpr, W: tl.constexpr, BNS: tl.constexpr,
                         NSC: tl.constexpr, NSP: tl.constexpr):
    """_combine_splits with the split count a constant NSC: the splits' (max, sum) pairs in one load,
    the partial rows in an unrolled loop whose loads depend on no earlier iteration (the compiler may
    issue them together, where the run-time loop waits on memory once per BNS splits, twice over)."""
    ka = tl.arange(0, NSP)                               # NSP: NSC rounded up to a power of two
    mk = tl.load(part_ml + (base + ka) * 2, mask=ka < NSC, other=float("-inf"))
    sk = tl.load(part_ml + (base + ka) * 2 + 1, mask=ka < NSC, other=0.0)
    top = tl.max(mk, axis=0)
    den = tl.sum(tl.where(mk > float("-inf"), tl.exp(mk - top), 0.0) * sk, axis=0)
    acc = tl.zeros([W], tl.float32)
    for i in tl.static_range(0, NSC, BNS):
        k = i + tl.arange(0, BNS)
        km = k < NSC
        o = tl.load(part_o + (base + k)[:, None] * L + ol[None, :], mask=km[:, None], other=0.0)
        mc = tl.load(part_ml + (base + k) * 2, mask=km, other=float("-inf"))
        w = tl.where(mc > float("-inf"), tl.exp(mc - top), 0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
    return acc / den


@triton.jit
def mla_combine_kernel(part_o, part_ml, out, H, NS, som, soh, L: tl.constexpr, BNS: tl.constexpr,
                       BL: tl.constexpr = 0):
    """Program (m, h, j): o = sum_i exp(max_i - max) o_i / sum_i exp(max_i - max) sum_i over the
    splits (empty ones, max -inf, weigh 0), in out's dtype, for the j-th BL columns of o (BL = 0: all
    L; each program of a head recomputes the splits' weights, which are 2 floats per split)."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    base = (m * H + h) * NS
    if BL:
        ol = tl.program_id(2) * BL + tl.arange(0, BL)
    else:
        ol = tl.arange(0, L)
    o = _combine_splits(part_o, part_ml, base, NS, ol, L, BL if BL else L, BNS)
    tl.store(out + m * som + h * soh + ol, o.to(out.dtype.element_ty))


@triton.jit
def mla_combine_uv_kernel(part_o, part_ml, w, gate, out, H, NS, V, swh, swl, swv, sgm, sgh, sgv,
                          L: tl.constexpr, BNS: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                          NSC: tl.constexpr = 0, NSP: tl.constexpr = 1):
    """Program (m, h, j): the combine of mla_combine_kernel for (token m, head h), rounded to out's
    dtype (the MLA op's output), then its value up-projection for columns [j*BV, +BV) of V:
    out[m, h, v] = sum_l o[l] * W[h, l, v] (W's strides swh / swl / swv: W_uv stored [H, V, L] or
    [H, L, V]), rounded, times sigmoid(gate[m, h, v]) rounded (GATE), as k3::decode_bmm computes it.
    out [M, H, V] contiguous. No o_lat round trip through memory and no second launch.
    NSC > 0: NS is that constant (_combine_splits_flat), and W's columns and the gate are loaded first."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    base = (m * H + h) * NS
    ol = tl.arange(0, L)
    dt = out.dtype.element_ty
    ov = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = ov < V
    if NSC:
        wt = tl.load(w + h * swh + ov[:, None] * swv + ol[None, :] * swl, mask=vm[:, None], other=0.0)
        if GATE:
            g = tl.load(gate + m * sgm + h * sgh + ov * sgv, mask=vm, other=0.0)
        o = _combine_splits_flat(part_o, part_ml, base, ol, L, L, BNS, NSC, NSP).to(dt).to(tl.float32)
    else:
        o = _combine_splits(part_o, part_ml, base, NS, ol, L, L, BNS).to(dt).to(tl.float32)
        wt = tl.load(w + h * swh + ov[:, None] * swv + ol[None, :] * swl, mask=vm[:, None], other=0.0)
        if GATE:
            g = tl.load(gate + m * sgm + h * sgh + ov * sgv, mask=vm, other=0.0)
    y = tl.sum(wt.to(tl.float32) * o[None, :], axis=1).to(dt)
    if GATE:
        y = (y.to(tl.float32) * tl.sigmoid(g.to(tl.float32)).to(dt).to(tl.float32)).to(dt)
    tl.store(out + (m * H + h) * V + ov, y, mask=vm)
