"""Triton kernels for the routed MXFP4 experts at decode batch sizes.

Three variants of the same two kernels (selected by `launch.mxfp4_experts(variant=...)` or env
K3_MXFP4; all share the contract below and are checked against the model's reference op):

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
    aot_check verifies). The 2^(126-100) is folded into the scale exponent, exp2(s - 101). Larger
    byte tiles (BKB) and `num_stages` / `num_warps` are launch parameters for a GPU sweep.
dot and v2b take LOOP: 0 unrolls the k loop (like v1), 1 makes it a runtime `tl.range` loop that
Triton software-pipelines with `num_stages` (more bytes in flight per SM).

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
