"""Triton kernels for the routed MXFP4 experts at decode batch sizes (Hopper has no FP4 tensor
cores, so the weights are dequantised in registers and the products summed on the CUDA cores).

Two kernels, one program per (token, slot) pair and row block; each pair reads only its own
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
    p = tl.program_id(0)
    i0 = tl.program_id(1) * BI
    e = tl.load(ids + p).to(tl.int64)
    t = p // K
    rows = i0 + tl.arange(0, BI)
    wb = w13 + e * (2 * I) * (L // 2)
    sb = s13 + e * (2 * I) * (L // 32)
    g = _fp4_dot_rows(wb, sb, rows, L // 2, L // 32, x + t * L, L // 2, BKB)
    u = _fp4_dot_rows(wb, sb, I + rows, L // 2, L // 32, x + t * L, L // 2, BKB)
    # SiTU in fp32: beta * tanh(g / beta) * sigmoid(g) * lbeta * tanh(u / lbeta)
    tg = 2.0 * tl.sigmoid(2.0 * g / beta) - 1.0
    tu = 2.0 * tl.sigmoid(2.0 * u / lbeta) - 1.0
    tl.store(mid + p * I + rows, beta * tg * tl.sigmoid(g) * (lbeta * tu))


@triton.jit
def mxfp4_down_kernel(mid, ids, w2, s2, out, I: tl.constexpr, L, BL: tl.constexpr, BKB: tl.constexpr):
    p = tl.program_id(0)
    l0 = tl.program_id(1) * BL
    e = tl.load(ids + p).to(tl.int64)
    rows = l0 + tl.arange(0, BL)
    acc = _fp4_dot_rows(w2 + e * L * (I // 2), s2 + e * L * (I // 32), rows, I // 2, I // 32,
                        mid + p * I, I // 2, BKB)
    tl.store(out + p * L + rows, acc.to(out.dtype.element_ty))
