"""Triton kernels for the routed MXFP4 experts at decode batch sizes.

Four variants of the same two kernels (selected by `moe.mxfp4_experts(variant=...)` or env
K3_KNOBS mxfp4; all share the contract below and are checked against the model's reference op):

v1  (`mxfp4_gate_up_kernel`, `mxfp4_down_kernel`): Hopper has no FP4 tensor cores, so the weights
    are dequantised in registers (via fp16 bit patterns, then an fp16->fp32 conversion) and the
    products summed on the CUDA cores.
dot (`mxfp4_gate_up_dot_kernel`, `mxfp4_down_dot_kernel`): swap-AB `tl.dot_scaled`. A = the weight
    tile W[rows, k] as packed e2m1 bytes [BN, BKB] with its E8M0 scales [BN, BKB/16] (Triton's format
    is ours: first element in the low nibble, one 2^(s-127) scale per 32 consecutive k of a row);
    B = the pair's activation as a [2*BKB, BT=16] bf16 tile whose column 0 is the vector and the
    other columns zero. On sm_90 Triton upcasts A to bf16 (with the scale) and runs the MMA, so the
    dequantisation is Triton's (not per-code integer tricks) and the sums run on tensor cores; 15/16
    of the MMA is wasted on the zero columns, which is free at decode (memory bound). Activations
    are rounded to bf16 (x is bf16 in the model; the down kernel rounds the fp32 SiTU output).
    One (token, slot) pair per program; pairs sharing an expert are not grouped.
v2b (`mxfp4_gate_up_v2b_kernel`, `mxfp4_down_v2b_kernel`): v1's structure, but each code goes
    straight to an fp32 bit pattern, ((c & 7) << 22) | ((c & 8) << 28) = value(c) * 2^-126, with
    three integer ops per code (two shifts and a LOP3-able and/or, written on the whole byte) and no
    fp16->fp32 conversion. Codes 1 and 9 (+-0.5) are fp32 subnormals there, so the activation
    is pre-scaled by 2^100 (once per k, not per code): every product value(c) * x * 2^-26 is then a
    normal number; the multiply/FMA must not flush subnormal *inputs* (PTX without .ftz, which
    bench/aot_check.py verifies). The 2^(126-100) is folded into the scale exponent, exp2(s - 101). Larger
    byte tiles (BKB) and `num_stages` / `num_warps` are launch parameters for a GPU sweep.
dot and v2b take LOOP: 0 unrolls the k loop (like v1), 1 makes it a runtime `tl.range` loop that
Triton software-pipelines with `num_stages` (more bytes in flight per SM).
v3  (`mxfp4_gate_up_v3_kernel`, `mxfp4_down_v3_kernel`): dequantisation two codes per 32-bit op,
    products on tensor cores. The weights are read as int32 words (8 codes; one 16-byte load per
    thread per 4 words); for k = 0..3 the nibble pair (code 8n+k, code 8n+k+4) of word n becomes two
    bf16 bit patterns ((c & 7) << 6) | ((c & 8) << 12) = value(c) * 2^-126 in one int32 with 3
    integer ops (AND, IMAD by 2^a + 2^b, AND; +-0.5 are bf16 subnormals, which the MMA takes as
    they are), and that int32 *is* an MMA operand register: the A tile's K order is a fixed
    permutation of the codes (_v3_a_tile: built with tl.join / tl.permute / tl.reshape, whose
    element order is defined) that follows the MMA fragment, so Triton reshapes it into the
    wgmma register operand without a shared-memory round trip. Swap-AB as in dot: the weights are
    the MMA's M side; B [K, BT=16] is block-diagonal: column j holds the activation (gathered with
    the same permutation, pre-scaled by 2^100 in bf16, exact, so no product is subnormal) on the
    32 K positions of scale block j, so one k step of BKB <= 256 bytes leaves each block's partial
    sum in its own column and the E8M0 scales 2^(s-127) * 2^126 / 2^100 are applied once per step
    as a [rows, 16] multiply-add (scale built from its fp32 bits, one IMAD). The 15 idle MMA columns
    of dot carry the scale blocks here. FP16=1 uses fp16 patterns ((c & 8) << 12) | ((c & 7) << 9)
    = value * 2^-14 and an fp16 activation tile instead: more mantissa (SiTU output rounded to
    2^-11, not 2^-8), but |x| > 65504 overflows and |x| < 2^-14 loses bits (x is not pre-scaled;
    fine for normed activations, not guaranteed). Activations are rounded to bf16 (fp16) as in dot.
    DOT_F32=1 (the CPU interpreter only, whose bf16 tl.dot is wrong and which flushes bf16
    subnormals) runs the same bit patterns, permutation and scales with an fp32 dot.
    Always the pipelined runtime loop (num_stages).
v3g (`mxfp4_*_v3g_kernel`, below): v3 over the pairs grouped by expert (block-diagonal columns
    per pair and scale block). v4g (the same kernels with V4=1): the grouping of v3g (by
    mxfp4_group_count_kernel, a counting sort) with the E8M0 scales multiplied into v3's A tile
    (each value times 2^(s-64) in bf16: A = value(c) * 2^(s-190), exact for 57 <= s <= 191; s >= 192
    gives inf, smaller s lose bits) and one plain MMA column per pair. The B operands are stored in
    the A tile's K order and times 2^63 beforehand (v4g_operand_kernel for x; gate-up stores mid,
    rounded to bf16, that way), so each k step's B is a contiguous [TG, 8*BW] load that Triton
    pipelines with cp.async, and the products value * x * 2^(s-127) are exact. V4=2 (the default,
    launch's MUL2): the scale multiplies each int32 pair of patterns with one mul.rn.bf16x2
    (inline PTX; 1.2x the scalar bf16 multiplies of V4=1 on the H200). The CPU interpreter takes
    the scalar path in fp32 (DOT_F32).

Each variant has two kernels, one program per (token, slot) pair and row block; each pair reads only its own
expert's bytes, which is what decode is bound by:
  gate_up: mid[p] = SiTU(W13[e] @ x[t])    fp32 [P, I]   (gate rows 0..I-1, up rows I..2I-1)
  down:    out[p] = W2[e] @ mid[p]         model dtype [P, L], unweighted and unfinalised
Dequantisation: an E2M1 code c (sign, 2 exponent bits, 1 mantissa bit) is placed in an fp16 bit
pattern, ((c & 8) << 12) | ((c & 7) << 9), which is exactly value(c) * 2^-14 (subnormals too);
the 2^14 is folded into the block scale 2^(s - 127). Bytes hold two codes, low nibble first.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dq(c):
    """E2M1 codes (int32, 0..15) -> value * 2^-14 in fp32."""
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pair(ids, BR: tl.constexpr):
    """This program's (token, slot) pair p, its expert e (int64) and its block of BR output rows."""
    p = tl.program_id(0)
    e = tl.load(ids + p).to(tl.int64)
    return p, e, tl.program_id(1) * BR + tl.arange(0, BR)


@triton.jit
def _situ(g, u, beta, lbeta):
    """SiTU in fp32: beta * tanh(g / beta) * sigmoid(g) * lbeta * tanh(u / lbeta)."""
    tg = 2.0 * tl.sigmoid(2.0 * g / beta) - 1.0
    tu = 2.0 * tl.sigmoid(2.0 * u / lbeta) - 1.0
    return beta * tg * tl.sigmoid(g) * (lbeta * tu)


@triton.jit
def _fp4_dot_rows(w_ptr, s_ptr, rows, row_bytes, row_scales, v_ptr, KB: tl.constexpr, BKB: tl.constexpr):
    """sum_k W[rows, k] * v[k] for one vector v (fp32 accumulate): W packed MXFP4 rows of
    `row_bytes` bytes with `row_scales` E8M0 bytes each; KB = bytes per row (constexpr).
    (An element-wise accumulator reduced once at the end, with scales built from their bits, was
    measured 1.4x slower on the H200: BENCHMARKS.md.)"""
    acc = tl.zeros([rows.shape[0]], tl.float32)
    for kb in tl.static_range(0, KB, BKB):
        cols = kb + tl.arange(0, BKB)
        b = tl.load(w_ptr + rows[:, None] * row_bytes + cols[None, :]).to(tl.int32)
        ve = tl.load(v_ptr + 2 * cols).to(tl.float32)
        vo = tl.load(v_ptr + 2 * cols + 1).to(tl.float32)
        prod = _dq(b & 15) * ve[None, :] + _dq(b >> 4) * vo[None, :]           # [R, BKB]
        blk = tl.sum(tl.reshape(prod, [rows.shape[0], BKB // 16, 16]), 2)        # [R, BKB/16]
        s = tl.load(s_ptr + rows[:, None] * row_scales + kb // 16 + tl.arange(0, BKB // 16)[None, :])
        acc += tl.sum(blk * tl.exp2(s.to(tl.float32) - 113.0), 1)             # 2^(s-127) * 2^14
    return acc


@triton.jit
def mxfp4_gate_up_kernel(x, ids, w13, s13, mid, K: tl.constexpr, I, L: tl.constexpr, beta, lbeta,
                         BI: tl.constexpr, BKB: tl.constexpr):
    p, e, rows = _pair(ids, BI)
    t = p // K
    wb = w13 + e * (2 * I) * (L // 2)
    sb = s13 + e * (2 * I) * (L // 32)
    g = _fp4_dot_rows(wb, sb, rows, L // 2, L // 32, x + t * L, L // 2, BKB)
    u = _fp4_dot_rows(wb, sb, I + rows, L // 2, L // 32, x + t * L, L // 2, BKB)
    tl.store(mid + p * I + rows, _situ(g, u, beta, lbeta))


@triton.jit
def mxfp4_down_kernel(mid, ids, w2, s2, out, I: tl.constexpr, L, BL: tl.constexpr, BKB: tl.constexpr):
    p, e, rows = _pair(ids, BL)
    acc = _fp4_dot_rows(w2 + e * L * (I // 2), s2 + e * L * (I // 32), rows, I // 2, I // 32,
                        mid + p * I, I // 2, BKB)
    tl.store(out + p * L + rows, acc.to(out.dtype.element_ty))


# ---------------------------------------------------------------- variant "dot" (tl.dot_scaled)

@triton.jit
def _fp4_tc_step(acc, w_ptr, s_ptr, rows, row_bytes, row_scales, v_ptr, kb, BKB: tl.constexpr, BT: tl.constexpr):
    col0 = (tl.arange(0, BT) == 0)[None, :]
    cols = kb + tl.arange(0, BKB)
    a = tl.load(w_ptr + rows[:, None] * row_bytes + cols[None, :])                              # u8 [R, BKB]
    s = tl.load(s_ptr + rows[:, None] * row_scales + kb // 16 + tl.arange(0, BKB // 16)[None, :])
    v = tl.load(v_ptr + 2 * kb + tl.arange(0, 2 * BKB)).to(tl.float32)
    b = tl.where(col0, v[:, None], 0.0).to(tl.bfloat16)                                         # [2BKB, BT]
    return tl.dot_scaled(a, s, "e2m1", b, None, "bf16", acc=acc)


@triton.jit
def _fp4_dot_tc(w_ptr, s_ptr, rows, row_bytes, row_scales, v_ptr, KB: tl.constexpr, BKB: tl.constexpr,
                BT: tl.constexpr, LOOP: tl.constexpr):
    """sum_k W[rows, k] * v[k] through tl.dot_scaled (swap-AB: weights are the MMA's M side; the
    vector is column 0 of a [2*BKB, BT] bf16 tile, the rest zero). Uses only the dot_scaled
    signature Triton 3.6 and 3.9 share. LOOP=0: k loop unrolled (static_range); LOOP=1: a runtime
    tl.range loop, which Triton software-pipelines (cp.async) with the launch's num_stages."""
    acc = tl.zeros([rows.shape[0], BT], tl.float32)
    if LOOP == 0:
        for kb in tl.static_range(0, KB, BKB):
            acc = _fp4_tc_step(acc, w_ptr, s_ptr, rows, row_bytes, row_scales, v_ptr, kb, BKB, BT)
    else:
        for kb in tl.range(0, KB, BKB):
            acc = _fp4_tc_step(acc, w_ptr, s_ptr, rows, row_bytes, row_scales, v_ptr, kb, BKB, BT)
    return tl.sum(acc, 1)


@triton.jit
def mxfp4_gate_up_dot_kernel(x, ids, w13, s13, mid, K: tl.constexpr, I, L: tl.constexpr, beta, lbeta,
                             BN: tl.constexpr, BKB: tl.constexpr, BT: tl.constexpr, LOOP: tl.constexpr):
    p, e, rows = _pair(ids, BN)
    t = p // K
    wb = w13 + e * (2 * I) * (L // 2)
    sb = s13 + e * (2 * I) * (L // 32)
    g = _fp4_dot_tc(wb, sb, rows, L // 2, L // 32, x + t * L, L // 2, BKB, BT, LOOP)
    u = _fp4_dot_tc(wb, sb, I + rows, L // 2, L // 32, x + t * L, L // 2, BKB, BT, LOOP)
    tl.store(mid + p * I + rows, _situ(g, u, beta, lbeta))


@triton.jit
def mxfp4_down_dot_kernel(mid, ids, w2, s2, out, I: tl.constexpr, L, BN: tl.constexpr, BKB: tl.constexpr,
                          BT: tl.constexpr, LOOP: tl.constexpr):
    p, e, rows = _pair(ids, BN)
    acc = _fp4_dot_tc(w2 + e * L * (I // 2), s2 + e * L * (I // 32), rows, I // 2, I // 32,
                      mid + p * I, I // 2, BKB, BT, LOOP)
    tl.store(out + p * L + rows, acc.to(out.dtype.element_ty))


# ---------------------------------------------------------------- variant "v2b" (fp32 bit dequant)

@triton.jit
def _dq_lo32(b):
    """Low-nibble code of bytes b (int32 0..255) -> fp32 value * 2^-126 (bits 22..24 = e1 e0 m,
    bit 31 = sign)."""
    bits = ((b << 22) & 0x01C00000) | ((b << 28) & -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dq_hi32(b):
    """High-nibble code of bytes b -> fp32 value * 2^-126."""
    bits = ((b << 18) & 0x01C00000) | ((b << 24) & -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp4_rows32_step(acc, w_ptr, s_ptr, rows, row_bytes, row_scales, v_ptr, kb, BKB: tl.constexpr):
    cols = kb + tl.arange(0, BKB)
    b = tl.load(w_ptr + rows[:, None] * row_bytes + cols[None, :]).to(tl.int32)
    ve = tl.load(v_ptr + 2 * cols).to(tl.float32) * 1.2676506002282294e30                    # 2^100
    vo = tl.load(v_ptr + 2 * cols + 1).to(tl.float32) * 1.2676506002282294e30
    prod = _dq_lo32(b) * ve[None, :] + _dq_hi32(b) * vo[None, :]                               # [R, BKB]
    blk = tl.sum(tl.reshape(prod, [rows.shape[0], BKB // 16, 16]), 2)                          # [R, BKB/16]
    s = tl.load(s_ptr + rows[:, None] * row_scales + kb // 16 + tl.arange(0, BKB // 16)[None, :])
    return acc + tl.sum(blk * tl.exp2(s.to(tl.float32) - 101.0), 1)


@triton.jit
def _fp4_dot_rows32(w_ptr, s_ptr, rows, row_bytes, row_scales, v_ptr, KB: tl.constexpr, BKB: tl.constexpr,
                    LOOP: tl.constexpr):
    """As _fp4_dot_rows, with the fp32-bit dequantisation: products are value * v * 2^-26 (v is
    pre-scaled by 2^100 so that +-0.5 * 2^-126, an fp32 subnormal, times v is normal); the block
    scale 2^(s-127) * 2^26 = exp2(s - 101). LOOP as in _fp4_dot_tc."""
    acc = tl.zeros([rows.shape[0]], tl.float32)
    if LOOP == 0:
        for kb in tl.static_range(0, KB, BKB):
            acc = _fp4_rows32_step(acc, w_ptr, s_ptr, rows, row_bytes, row_scales, v_ptr, kb, BKB)
    else:
        for kb in tl.range(0, KB, BKB):
            acc = _fp4_rows32_step(acc, w_ptr, s_ptr, rows, row_bytes, row_scales, v_ptr, kb, BKB)
    return acc


@triton.jit
def mxfp4_gate_up_v2b_kernel(x, ids, w13, s13, mid, K: tl.constexpr, I, L: tl.constexpr, beta, lbeta,
                             BI: tl.constexpr, BKB: tl.constexpr, LOOP: tl.constexpr):
    p, e, rows = _pair(ids, BI)
    t = p // K
    wb = w13 + e * (2 * I) * (L // 2)
    sb = s13 + e * (2 * I) * (L // 32)
    g = _fp4_dot_rows32(wb, sb, rows, L // 2, L // 32, x + t * L, L // 2, BKB, LOOP)
    u = _fp4_dot_rows32(wb, sb, I + rows, L // 2, L // 32, x + t * L, L // 2, BKB, LOOP)
    tl.store(mid + p * I + rows, _situ(g, u, beta, lbeta))


@triton.jit
def mxfp4_down_v2b_kernel(mid, ids, w2, s2, out, I: tl.constexpr, L, BL: tl.constexpr, BKB: tl.constexpr,
                          LOOP: tl.constexpr):
    p, e, rows = _pair(ids, BL)
    acc = _fp4_dot_rows32(w2 + e * L * (I // 2), s2 + e * L * (I // 32), rows, I // 2, I // 32,
                          mid + p * I, I // 2, BKB, LOOP)
    tl.store(out + p * L + rows, acc.to(out.dtype.element_ty))


# ---------------------------------------------------------------- variant "v3" (bf16x2 bit dequant, tensor cores)

@triton.jit
def _v3_pair(w, k: tl.constexpr, FP16: tl.constexpr):
    """Codes 8n+k (low 16 bits) and 8n+k+4 (high 16 bits) of packed words w (int32, 8 codes each,
    code 8n+j in nibble j) as two 16-bit float patterns, 3 integer ops per pair (AND, IMAD, AND:
    the nibble pair masked in place, then one multiply by 2^a + 2^b puts the 3 magnitude bits and
    the sign where they belong (the two shifted copies do not overlap, so no carries), then the
    final mask keeps them). k = 2, 3 work on w >> 8 (one shift per word, shared).
    bf16 (FP16=0): bits ((c & 7) << 6) | ((c & 8) << 12) = value(c) * 2^-126 (+-0.5: subnormal);
    fp16 (FP16=1): bits ((c & 7) << 9) | ((c & 8) << 12) = value(c) * 2^-14 (+-0.5: subnormal)."""
    if k >= 2:
        w = w >> 8
    if k % 2 == 0:
        n = w & 0x000F000F
        if FP16:
            b = ((n << 9) & 0x0E000E00) | ((n << 12) & -2147450880)      # 0x80008000
        else:
            b = (n * 4160) & -2118090304                                 # 2^6 + 2^12; 0x81C081C0
    else:
        n = w & 0x00F000F0
        if FP16:
            b = ((n << 5) & 0x0E000E00) | ((n << 8) & -2147450880)
        else:
            b = (n * 260) & -2118090304                                  # 2^2 + 2^8
    return b


@triton.jit
def _v3_halves(b, FP16: tl.constexpr, DOT_F32: tl.constexpr):
    """int32 -> (low 16 bits, high 16 bits) as bf16 / fp16 bit patterns. DOT_F32 (CPU interpreter,
    which flushes bf16 subnormals when it converts them): the same bf16 patterns placed in the top
    half of fp32 words instead (exactly the bf16 value, subnormals included)."""
    if FP16:
        lo = b.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (b >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        if DOT_F32:
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
    elif DOT_F32:
        lo = (b << 16).to(tl.float32, bitcast=True)
        hi = (b & -65536).to(tl.float32, bitcast=True)
    else:
        lo = b.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (b >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _bf16x2_mul(b, m):
    """Two bf16 products in one instruction: the bf16 pairs packed in int32 words b and m."""
    return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [b, m], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _v3_a_tile(w, FP16: tl.constexpr, DOT_F32: tl.constexpr, s=None, MUL2: tl.constexpr = False):
    """Weight words [R, BW] (BW % 16 == 0) -> A tile [R, 8*BW] (bf16 / fp16 value * 2^-126 /
    2^-14; DOT_F32: fp32, see _v3_halves). K order, per group of 16 words (128 codes): position
    q = 32*c2 + 16*k1 + 8*k0 + 2*t + h holds code k + 4h (k = 2*k1 + k0) of word n = 4*t + c2.
    It follows the MMA operand fragment (m16n8k16 / wgmma: lane t = lane % 4 holds K pairs 2t, 2t+1
    and 2t+8, 2t+9 of each 16): each thread then takes whole words (4 consecutive, one 16-byte
    load) and each int32 pair is one operand register (two K-adjacent elements), so the tile can
    reach the dot without a shared-memory round trip. tl.join adds the new minor dim and
    tl.reshape keeps row-major order, so the order is defined (unlike tl.cat's).
    s (v4g; bf16, not FP16): the words' E8M0 scales [R, BW/4], applied to the tile: each value
    times 2^(s-64), so A = value(c) * 2^(s-190) (module docstring, v4g). Word 4t + c2 of a group
    lies in scale block t of that group, so every thread multiplies its 4 words by one scale.
    MUL2 (GPU only): the scale multiplies each packed pair of patterns with one bf16x2 instruction
    instead of two bf16 ones."""
    R: tl.constexpr = w.shape[0]
    G: tl.constexpr = w.shape[1] // 16
    w4 = tl.reshape(w, [R, G, 4, 4])                    # [R, G, t, c2]
    b0 = _v3_pair(w4, 0, FP16)
    b1 = _v3_pair(w4, 1, FP16)
    b2 = _v3_pair(w4, 2, FP16)
    b3 = _v3_pair(w4, 3, FP16)
    PACKED: tl.constexpr = MUL2 and not DOT_F32    # the scale on the packed pairs, else on the halves
    if s is not None:
        # 2^(s-64) from its exponent field s + 63 (bf16 / fp32 bits); s >= 192 would overflow the
        # field: clamped to 255, +inf, so such a weight shows as inf / NaN, not as a wrong number
        f = tl.reshape(tl.minimum(s.to(tl.int32) + 63, 255), [R, G, 4])[:, :, :, None]
        if PACKED:
            m = (f << 7) | (f << 23)
            b0, b1, b2, b3 = _bf16x2_mul(b0, m), _bf16x2_mul(b1, m), _bf16x2_mul(b2, m), _bf16x2_mul(b3, m)
    l0, h0 = _v3_halves(b0, FP16, DOT_F32)
    l1, h1 = _v3_halves(b1, FP16, DOT_F32)
    l2, h2 = _v3_halves(b2, FP16, DOT_F32)
    l3, h3 = _v3_halves(b3, FP16, DOT_F32)
    if s is not None and not PACKED:
        if DOT_F32:
            sc = (f << 23).to(tl.float32, bitcast=True)
        else:
            sc = (f << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        l0, h0, l1, h1 = l0 * sc, h0 * sc, l1 * sc, h1 * sc
        l2, h2, l3, h3 = l2 * sc, h2 * sc, l3 * sc, h3 * sc
    x = tl.join(tl.join(tl.join(l0, h0), tl.join(l1, h1)),
                tl.join(tl.join(l2, h2), tl.join(l3, h3)))          # [R, G, t, c2, h, k0, k1]
    x = tl.permute(x, (0, 1, 3, 6, 5, 2, 4))                         # [R, G, c2, k1, k0, t, h]
    return tl.reshape(x, [R, G * 128])


@triton.jit
def _v3_code(q):
    """Code index (relative to the group's first code) of A-tile K position q (see _v3_a_tile)."""
    c2 = (q >> 5) & 3
    k = ((q >> 3) & 3)                                   # 2*k1 + k0
    t = (q >> 1) & 3
    return (q & -128) + 8 * (4 * t + c2) + k + 4 * (q & 1)


@triton.jit
def _v3_step(acc, w_ptr, s_ptr, rows, row_words, row_scales, v_ptr, kw, BW: tl.constexpr, BT: tl.constexpr,
             FP16: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [R, BT] += (A @ B) * scale for the BW words (8*BW codes, NB = BW/4 scale blocks) of
    each row starting at word kw. B [8*BW, BT] is block-diagonal: column j holds the activation
    (permuted like A's K order) on the 32 K positions of scale block j and 0 elsewhere, so the MMA
    leaves each block's partial sum in its own column and the scales are applied once per NB
    blocks as a [R, BT] multiply-add (columns >= NB stay 0). DOT_F32: an fp32 dot on the same
    values (A from the same bit patterns, _v3_halves; B upcast exactly): the CPU interpreter."""
    DT: tl.constexpr = tl.float16 if FP16 else tl.bfloat16
    NB: tl.constexpr = BW // 4
    w = tl.load(w_ptr + rows[:, None] * row_words + kw + tl.arange(0, BW)[None, :])          # int32 [R, BW]
    a = _v3_a_tile(w, FP16, DOT_F32)                                                      # [R, 8BW]
    q = tl.arange(0, 8 * BW)
    v = tl.load(v_ptr + 8 * kw + _v3_code(q)).to(tl.float32)
    if not FP16:
        v = v * 1.2676506002282294e30                                                     # 2^100
    col = tl.arange(0, BT)
    blk = _v3_code(q) // 32                                                                 # scale block of q
    # built as B^T [BT, 8BW] (K-contiguous registers: 16-byte shared-memory stores), then transposed
    b = tl.trans(tl.where(col[:, None] == blk[None, :], v.to(DT)[None, :], 0.0).to(DT))    # [8BW, BT]
    if DOT_F32:
        part = tl.dot(a, b.to(tl.float32))
    else:
        part = tl.dot(a, b)
    s = tl.load(s_ptr + rows[:, None] * row_scales + kw // 4 + col[None, :], mask=col[None, :] < NB, other=0)
    # the block scale 2^(s-127) times 2^126 (bf16 bit trick) / 2^100 (x pre-scale) = 2^(s-101), or
    # 2^(s-113) for fp16 (2^14, no pre-scale), built from its fp32 bits with one IMAD: exponent
    # field s + 26 (s + 14). s >= 229 (fp16: >= 241) would overflow the field: clamped there to the
    # field 255, +inf, which is also what v2b's exp2(s - 101) gives for them (the reference: a
    # finite value, NaN for the E8M0 NaN byte 255; no real weight has a scale >= 2^102).
    OFF: tl.constexpr = 14 if FP16 else 26
    e = tl.minimum(s.to(tl.int32), 255 - OFF)
    sc = (e * 8388608 + OFF * 8388608).to(tl.float32, bitcast=True)
    return acc + part * sc


@triton.jit
def _fp4_dot_v3(w_ptr, s_ptr, rows, row_bytes, row_scales, v_ptr, KB: tl.constexpr, BKB: tl.constexpr,
                BT: tl.constexpr, FP16: tl.constexpr, DOT_F32: tl.constexpr):
    """sum_k W[rows, k] * v[k] on tensor cores (swap-AB, see _v3_step), runtime tl.range k loop
    (software-pipelined with the launch's num_stages). w_ptr: the rows' bytes (16-byte aligned)."""
    BW: tl.constexpr = BKB // 4
    wp = w_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([rows.shape[0], BT], tl.float32)
    for kw in tl.range(0, KB // 4, BW):
        acc = _v3_step(acc, wp, s_ptr, rows, row_bytes // 4, row_scales, v_ptr, kw, BW, BT, FP16, DOT_F32)
    return tl.sum(acc, 1)


@triton.jit
def mxfp4_gate_up_v3_kernel(x, ids, w13, s13, mid, K: tl.constexpr, I, L: tl.constexpr, beta, lbeta,
                            BI: tl.constexpr, BKB: tl.constexpr, BT: tl.constexpr, FP16: tl.constexpr,
                            DOT_F32: tl.constexpr):
    """One dot per k step over 2*BI rows: this block's BI gate rows, then its BI up rows."""
    p = tl.program_id(0)
    e = tl.load(ids + p).to(tl.int64)
    t = p // K
    r = tl.arange(0, 2 * BI)
    rows = tl.program_id(1) * BI + tl.where(r < BI, r, I + r - BI)
    wb = w13 + e * (2 * I) * (L // 2)
    sb = s13 + e * (2 * I) * (L // 32)
    gu = tl.reshape(_fp4_dot_v3(wb, sb, rows, L // 2, L // 32, x + t * L, L // 2, BKB, BT, FP16, DOT_F32),
                    [2, BI])
    first = (tl.arange(0, 2) == 0)[:, None]
    g = tl.sum(tl.where(first, gu, 0.0), 0)
    u = tl.sum(tl.where(first, 0.0, gu), 0)
    tl.store(mid + p * I + tl.program_id(1) * BI + tl.arange(0, BI), _situ(g, u, beta, lbeta))


@triton.jit
def mxfp4_down_v3_kernel(mid, ids, w2, s2, out, I: tl.constexpr, L, BL: tl.constexpr, BKB: tl.constexpr,
                         BT: tl.constexpr, FP16: tl.constexpr, DOT_F32: tl.constexpr):
    p, e, rows = _pair(ids, BL)
    acc = _fp4_dot_v3(w2 + e * L * (I // 2), s2 + e * L * (I // 32), rows, I // 2, I // 32,
                      mid + p * I, I // 2, BKB, BT, FP16, DOT_F32)
    tl.store(out + p * L + rows, acc.to(out.dtype.element_ty))


# ---------------------------------------------------------------- variant "v3g" (v3, pairs grouped by expert)
# The per-pair kernels above dequantise an expert's weights once for every token routed to it. v3g
# groups the pairs by expert first (mxfp4_group_count_kernel: one program counts the P expert ids
# into runs and cuts each expert's run into tiles of up to TG pairs), then runs v3's k loop once per (tile, row
# block) with the tile's TG activation vectors as MMA columns: B [8*BW, NB*TG], column j*TG + i
# holds token i's activation on the K positions of scale block j (block-diagonal per token, as
# v3's one column per block), so each weight is dequantised once per TG tokens. The GEMV programs
# are persistent: program (q, rb) takes tiles q, q + grid0, ... (launch: about PROGS in all).

@triton.jit
def mxfp4_group_count_kernel(ids, order, sorted_e, tstart, ws, P, PB: tl.constexpr, EB: tl.constexpr,
                             TG: tl.constexpr):
    """One program groups the P pairs by expert (a counting sort by atomics): order = the pairs
    in their experts' runs, the runs in expert order (within a run in the order the atomics served
    them, not by pair: a pair's output does not depend on its column), sorted_e = their experts,
    tstart[t] = the position where tile t starts (each run cut into tiles of TG pairs), -1 for t
    >= the number of tiles. The experts' pair counts, their exclusive prefix sums (where each run
    starts) and tile bases, then each pair takes the next slot of its run with an atomic. ws:
    int32 scratch [3 * EB] (EB: a power of two > every expert id), left with no contents needed
    by the next call. The loads after the atomics read L2 (.cg), where the atomics ran. (A
    one-program tl.sort of the keys, the first form, measured within 1.5% of this at M = 16..256.)"""
    i = tl.arange(0, PB)
    live = i < P
    e = tl.load(ids + i, mask=live, other=0).to(tl.int32)
    b = tl.arange(0, EB)
    tl.store(ws + b, tl.zeros([EB], tl.int32))
    tl.store(tstart + i, -1, mask=live)
    tl.debug_barrier()
    tl.atomic_add(ws + e, 1, mask=live, sem="relaxed", scope="cta")                  # pairs per expert
    tl.debug_barrier()
    cnt = tl.load(ws + b, cache_modifier=".cg")
    start = tl.cumsum(cnt, 0) - cnt
    ntile = (cnt + TG - 1) // TG
    tl.debug_barrier()
    tl.store(ws + b, start)
    tl.store(ws + EB + b, start)                                                     # the runs' cursors
    tl.store(ws + 2 * EB + b, tl.cumsum(ntile, 0) - ntile)                          # first tile of each run
    tl.debug_barrier()
    pos = tl.atomic_add(ws + EB + e, 1, mask=live, sem="relaxed", scope="cta")
    rank = pos - tl.load(ws + e, mask=live, other=0, cache_modifier=".cg")
    tile = tl.load(ws + 2 * EB + e, mask=live, other=0, cache_modifier=".cg") + rank // TG
    tl.store(order + pos, i, mask=live)
    tl.store(sorted_e + pos, e, mask=live)
    tl.store(tstart + tile, pos, mask=live & (rank % TG == 0))


@triton.jit
def _v3g_step(acc, w_ptr, s_ptr, rows, row_words, row_scales, v_ptr, voff, vok, kw, BW: tl.constexpr,
              TG: tl.constexpr, FP16: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [R, TG] += the BW words' (NB = BW/4 scale blocks') products for TG activation vectors
    at v_ptr + voff[i] (vok: live ones). The vectors are loaded once ([TG, 8BW], in A's K order)
    and spread block-diagonally: B column j*TG + i = vector i on block j's K positions."""
    DT: tl.constexpr = tl.float16 if FP16 else tl.bfloat16
    NB: tl.constexpr = BW // 4
    w = tl.load(w_ptr + rows[:, None] * row_words + kw + tl.arange(0, BW)[None, :])          # int32 [R, BW]
    a = _v3_a_tile(w, FP16, DOT_F32)                                                      # [R, 8BW]
    code = _v3_code(tl.arange(0, 8 * BW))
    v = tl.load(v_ptr + voff[:, None] + 8 * kw + code[None, :], mask=vok[:, None], other=0.0).to(tl.float32)
    if not FP16:
        v = v * 1.2676506002282294e30                                                     # 2^100
    on = tl.arange(0, NB)[:, None, None] == (code // 32)[None, None, :]                    # [NB, 1, 8BW]
    bt = tl.reshape(tl.where(on, v[None, :, :], 0.0), [NB * TG, 8 * BW])
    b = tl.trans(bt.to(DT))                                                               # [8BW, NB*TG]
    if DOT_F32:
        part = tl.dot(a, b.to(tl.float32))
    else:
        part = tl.dot(a, b)
    s = tl.load(s_ptr + rows[:, None] * row_scales + kw // 4 + tl.arange(0, NB)[None, :])  # [R, NB]
    OFF: tl.constexpr = 14 if FP16 else 26          # as in _v3_step
    sc = (tl.minimum(s.to(tl.int32), 255 - OFF) * 8388608 + OFF * 8388608).to(tl.float32, bitcast=True)
    return acc + tl.sum(tl.reshape(part, [rows.shape[0], NB, TG]) * sc[:, :, None], 1)


# v4g's activations (B operands) are stored times 2^63: with the A tile's value * 2^(s-190) the
# products are value * x * 2^(s-127), exact
V4G_X_SCALE = tl.constexpr(2.0 ** 63)


@triton.jit
def _v3_pos(c):
    """The inverse of _v3_code: the A-tile K position of code c (relative to its group's first
    code): word n = c // 8 = 4t + c2, nibble j = c % 8 = k + 4h -> q = 32*c2 + 8*k + 2*t + h."""
    n = (c >> 3) & 15
    j = c & 7
    return (c & -128) + 32 * (n & 3) + 8 * (j & 3) + 2 * (n >> 2) + (j >> 2)


@triton.jit
def v4g_operand_kernel(x, out, L, BLOCK: tl.constexpr):
    """out[n, q] = x[n, code(q)] * 2^63 (in out's dtype): v4g's gate-up B operand, the activation's
    columns in the A tile's K order (_v3_code; L % 128 == 0), so the expert kernel's B loads are
    contiguous. Exact for |x| < 2^65 (bf16 x into bf16: a power-of-two scaling)."""
    n = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = q < L
    v = tl.load(x + n * L + _v3_code(q), mask=ok, other=0.0).to(tl.float32)
    tl.store(out + n * L + q, (v * V4G_X_SCALE).to(out.dtype.element_ty), mask=ok)


@triton.jit
def _v4g_step(acc, w_ptr, s_ptr, rows, row_words, row_scales, v_ptr, voff, vok, kw, BW: tl.constexpr,
              DOT_F32: tl.constexpr, MUL2: tl.constexpr):
    """acc [R, TG] += A @ B for the BW words of each row from word kw: A the scaled weight tile
    (_v3_a_tile with s: value * 2^(s-190)), B the TG activation vectors at v_ptr + voff[i] (vok:
    live ones), stored already in A's K order and times 2^63 (bf16; fp32 with DOT_F32): a
    contiguous [TG, 8BW] load, one plain MMA column per vector."""
    w = tl.load(w_ptr + rows[:, None] * row_words + kw + tl.arange(0, BW)[None, :])          # int32 [R, BW]
    s = tl.load(s_ptr + rows[:, None] * row_scales + kw // 4 + tl.arange(0, BW // 4)[None, :])
    a = _v3_a_tile(w, False, DOT_F32, s, MUL2)                                            # [R, 8BW]
    v = tl.load(v_ptr + voff[:, None] + 8 * kw + tl.arange(0, 8 * BW)[None, :], mask=vok[:, None], other=0.0)
    return tl.dot(a, tl.trans(v), acc)


@triton.jit
def _fp4_dot_v3g(w_ptr, s_ptr, rows, row_bytes, row_scales, v_ptr, voff, vok, KB: tl.constexpr,
                 BKB: tl.constexpr, TG: tl.constexpr, FP16: tl.constexpr, DOT_F32: tl.constexpr,
                 V4: tl.constexpr = 0):
    BW: tl.constexpr = BKB // 4
    wp = w_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([rows.shape[0], TG], tl.float32)
    for kw in tl.range(0, KB // 4, BW):
        if V4:   # 1: the scales by bf16 multiplies, 2: by bf16x2 ones
            acc = _v4g_step(acc, wp, s_ptr, rows, row_bytes // 4, row_scales, v_ptr, voff, vok, kw, BW, DOT_F32,
                            V4 == 2)
        else:
            acc = _v3g_step(acc, wp, s_ptr, rows, row_bytes // 4, row_scales, v_ptr, voff, vok, kw, BW, TG, FP16,
                            DOT_F32)
    return acc


@triton.jit
def _v3g_tile(order, sorted_e, tstart, t, P, TG: tl.constexpr):
    """Tile t: its first sorted position ts (< 0: no such tile), its expert (int64), and its TG
    columns' pairs and whether each is live (same expert, < P)."""
    ts = tl.load(tstart + t, mask=t < P, other=-1)
    e = tl.load(sorted_e + tl.maximum(ts, 0)).to(tl.int64)
    i = tl.arange(0, TG)
    pos = ts + i
    ok = (pos < P) & (pos - i >= 0)                                  # ts >= 0, as a vector
    ok = ok & (tl.load(sorted_e + pos, mask=ok, other=-1).to(tl.int64) == e)
    pair = tl.load(order + pos, mask=ok, other=0)
    return ts, e, pair, ok


@triton.jit
def mxfp4_gate_up_v3g_kernel(x, order, sorted_e, tstart, w13, s13, mid, P, K: tl.constexpr, I,
                             L: tl.constexpr, beta, lbeta, BI: tl.constexpr, BKB: tl.constexpr, TG: tl.constexpr,
                             FP16: tl.constexpr, DOT_F32: tl.constexpr, V4: tl.constexpr = 0):
    """Persistent over tiles: program (q, rb) takes tiles q, q + grid0, ... until the first empty one.
    V4: the v4g k step (scales in the A tile, TG plain MMA columns; 2: scaled by bf16x2 multiplies)."""
    r = tl.arange(0, 2 * BI)
    rows = tl.program_id(1) * BI + tl.where(r < BI, r, I + r - BI)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    first = (tl.arange(0, 2) == 0)[:, None, None]
    t = tl.program_id(0)
    ts, e, pair, ok = _v3g_tile(order, sorted_e, tstart, t, P, TG)
    while ts >= 0:
        wb = w13 + e * (2 * I) * (L // 2)
        sb = s13 + e * (2 * I) * (L // 32)
        acc = _fp4_dot_v3g(wb, sb, rows, L // 2, L // 32, x, (pair // K).to(tl.int64) * L, ok, L // 2, BKB, TG,
                           FP16, DOT_F32, V4)                                                  # [2BI, TG]
        gu = tl.reshape(acc, [2, BI, TG])
        g = tl.sum(tl.where(first, gu, 0.0), 0)
        u = tl.sum(tl.where(first, 0.0, gu), 0)
        y = _situ(g, u, beta, lbeta)
        if V4:   # down's B operand as _v4g_step reads it: A's K order, rounded to bf16, times 2^63
            pos = _v3_pos(cols)
            y = y.to(tl.bfloat16).to(tl.float32) * V4G_X_SCALE
        else:
            pos = cols
        tl.store(mid + pair[None, :].to(tl.int64) * I + pos[:, None], y.to(mid.dtype.element_ty), mask=ok[None, :])
        t += tl.num_programs(0)
        ts, e, pair, ok = _v3g_tile(order, sorted_e, tstart, t, P, TG)


@triton.jit
def mxfp4_down_v3g_kernel(mid, order, sorted_e, tstart, w2, s2, out, P, I: tl.constexpr, L, BL: tl.constexpr,
                          BKB: tl.constexpr, TG: tl.constexpr, FP16: tl.constexpr, DOT_F32: tl.constexpr,
                          V4: tl.constexpr = 0):
    rows = tl.program_id(1) * BL + tl.arange(0, BL)
    t = tl.program_id(0)
    ts, e, pair, ok = _v3g_tile(order, sorted_e, tstart, t, P, TG)
    while ts >= 0:
        acc = _fp4_dot_v3g(w2 + e * L * (I // 2), s2 + e * L * (I // 32), rows, I // 2, I // 32, mid,
                           pair.to(tl.int64) * I, ok, I // 2, BKB, TG, FP16, DOT_F32, V4)  # [BL, TG]
        tl.store(out + pair[None, :].to(tl.int64) * L + rows[:, None], acc.to(out.dtype.element_ty),
                 mask=ok[None, :])
        t += tl.num_programs(0)
        ts, e, pair, ok = _v3g_tile(order, sorted_e, tstart, t, P, TG)


# ---------------------------------------------------------------- SiTU of the shared expert (dense)

@triton.jit
def situ_kernel(gu, out, M, I, beta, lbeta, BLOCK: tl.constexpr):
    """out[m, i] = SiTU(gu[m, i], gu[m, I + i]) for a [M, 2I] gate|up GEMM output, fp32 math,
    stored in out's dtype (the shared expert's activation between its two GEMMs: one kernel where
    the PyTorch form launches one per elementwise op)."""
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gu + m * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu + m * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + m * I + cols, _situ(g, u, beta, lbeta).to(out.dtype.element_ty), mask=ok)
