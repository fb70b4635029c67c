"""PyTorch emulation of the CuTe MXFP4 expert GEMV (`mxfp4_experts.py`), for CPU tests.

The DSL cannot run a kernel without a GPU, so this reproduces the kernel's arithmetic on CPU:
the integer bit tricks that turn a packed word into fp32 operands (uint32 wrap-around emulated in
int64), the 2^100 activation pre-scale, the scale built from its fp32 bits, and the summation
order (per 32-code block: word j = 0..3, pair k = 0..3, code 8j+k+4 then code 8j+k; block sum
times scale; then Q partial sums of NV/Q blocks per row; then the Q sums). fp32 multiply + add
stands in for the kernel's fused multiply-add (a rounding difference of <= 1 ulp per step).
math="f16x2" (the "_h2" artifacts): code pairs as f16x2 value * 2^-14 (deq "prmt" or "shift"), the
thread's 32 activations times 2^kx (max |x| * 2^kx in [2^12, 2^13)) rounded to fp16, one fused
f16x2 multiply-add per pair (emulated: fp32 product + sum, rounded once to fp16), the two halves
summed in fp32, times 2^(s - 127 + 14) * 2^-kx.
Importing this module does not import the DSL.
"""
from __future__ import annotations

import functools

import torch

PRESCALE = 2.0 ** 100
SCALE_BIAS = 26
PAIR_MASK = (0x000F000F, 0x00F000F0)
PAIR_MUL = (4160, 260)
HI_MASK = 0x81C00000


def _f32(bits: torch.Tensor) -> torch.Tensor:
    """int64 holding uint32 bit patterns -> fp32."""
    b = bits & 0xFFFFFFFF
    b = torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32)
    return b.view(torch.float32)


def pair_bits(word: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's dequantisation of codes (8j+k+4, 8j+k) of packed words (int64, uint32 values):
    (hi, lo) as fp32 = value(code) * 2^-126, with the kernel's integer ops."""
    src = word if k < 2 else (word >> 8)
    m = ((src & PAIR_MASK[k % 2]) * PAIR_MUL[k % 2]) & 0xFFFFFFFF
    return _f32(m & HI_MASK), _f32((m << 16) & HI_MASK)


def scale_f32(s: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> 2^(s - 127) * 2^126 / 2^100 from its fp32 bits (s <= 228)."""
    return _f32((s.to(torch.int64) + SCALE_BIAS) << 23)


def words_of(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., KB] (KB % 16 == 0) -> int64 [..., KB/16, 4] little-endian uint32 words."""
    b = packed.to(torch.int64).reshape(*packed.shape[:-1], packed.shape[-1] // 16, 4, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def block_dot(words: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """words int64 [..., NV, 4], xs fp32 [..., NV, 32] (pre-scaled) -> block sums fp32 [..., NV]."""
    acc = torch.zeros(words.shape[:-1], dtype=torch.float32)
    for j in range(4):
        for k in range(4):
            hi, lo = pair_bits(words[..., j], k)
            acc = acc + hi * xs[..., 8 * j + k + 4]
            acc = acc + lo * xs[..., 8 * j + k]
    return acc


def _two_level_sum(part: torch.Tensor, q: int) -> torch.Tensor:
    """The kernels' reduction order of per-vector row partials [R, NV]: Q threads per row each sum
    NV / Q consecutive partials in order, then one thread sums the Q results in order."""
    R, nv = part.shape
    part = part.reshape(R, q, nv // q)
    s1 = torch.zeros(R, q, dtype=torch.float32)
    for c in range(nv // q):
        s1 = s1 + part[..., c]
    tot = torch.zeros(R, dtype=torch.float32)
    for c in range(q):
        tot = tot + s1[:, c]
    return tot


def rows_dot(packed: torch.Tensor, scales: torch.Tensor, vec: torch.Tensor, q: int) -> torch.Tensor:
    """sum_k W[r, k] * vec[k] for packed rows [R, KB], scales [R, KB/16], vec fp32 [2*KB], with the
    kernel's order: block sums * scale, Q partial sums of NV/Q blocks, then the Q sums."""
    R, KB = packed.shape
    nv = KB // 16
    xs = (vec.to(torch.float32) * PRESCALE).reshape(1, nv, 32)
    part = block_dot(words_of(packed), xs) * scale_f32(scales)          # [R, NV]
    return _two_level_sum(part, q)


def reduction_q(nv: int, rows: int, threads: int) -> int:
    """The kernel's level-1 split: the largest divisor Q of NV with rows * Q <= threads."""
    return max(d for d in range(1, nv + 1) if nv % d == 0 and rows * d <= threads)


H_MAG = ((0x00070007, 9), (0x00700070, 5), (0x07000700, 1), (0x70007000, -3))
H_SIGN = (12, 8, 4, 0)


def half_pair_bits(word: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The f16x2 dequantisation of codes (8j+k low half, 8j+k+4 high half) of words (int64 uint32
    values): (lo, hi) fp16 = value(code) * 2^-14."""
    mask, sh = H_MAG[k]
    n = word & mask
    mag = (n << sh) if sh > 0 else (n >> -sh)
    b = (mag | ((word << H_SIGN[k]) & 0x80008000)) & 0xFFFFFFFF
    lo, hi = b & 0xFFFF, b >> 16

    def f16(h):
        return torch.where(h >= 2 ** 15, h - 2 ** 16, h).to(torch.int16).view(torch.float16)
    return f16(lo), f16(hi)


PB_PAIRS = ((0, 2), (4, 6), (1, 3), (5, 7))     # mxfp4_experts.PB_PAIRS: (low, high) code of a word


def pb_pair_bits(word: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """deq="prmt": pair PB_PAIRS[i] of words (int64 uint32 values) with the kernel's ops: the bytes
    E (H of the even codes) or O (the odd ones), then prmt(src, 0, 0x1404 / 0x3424) (bytes 0, 1 or
    2, 3 of src into the high bytes of the halves): (lo, hi) fp16 = value(code) * 2^-14."""
    if i < 2:
        src = ((word << 1) & 0x0E0E0E0E) | ((word << 4) & 0x80808080)
    else:
        src = ((word >> 3) & 0x0E0E0E0E) | (word & 0x80808080)
    b0 = (src >> (16 * (i % 2))) & 0xFF            # selector nibble 1: byte 0 (or 2) of src
    b1 = (src >> (16 * (i % 2) + 8)) & 0xFF        # nibble 3: byte 1 (or 3)
    lo, hi = b0 << 8, b1 << 8                      # nibbles 0 and 2 select zero bytes

    def f16(h):
        return torch.where(h >= 2 ** 15, h - 2 ** 16, h).to(torch.int16).view(torch.float16)
    return f16(lo), f16(hi)


def x_scale_exp(xblk: torch.Tensor) -> torch.Tensor:
    """The kernel's per-thread exponent: max(exponent field of max |x| over the block, 20)."""
    bits = xblk.float().abs().view(torch.int32).amax(-1)
    return torch.clamp(bits >> 23, min=20).to(torch.int64)


def rows_dot_h2(packed: torch.Tensor, scales: torch.Tensor, vec: torch.Tensor, q: int,
                deq: str = "shift") -> torch.Tensor:
    """rows_dot with the f16x2 math; deq: the kernel's dequantisation ("shift": pairs (k, k + 4) of
    each word, k = 0..3; "prmt": PB_PAIRS), which sets the order of the f16x2 accumulation."""
    R, KB = packed.shape
    nv = KB // 16
    xb = vec.to(torch.float32).reshape(nv, 32)
    ex = x_scale_exp(xb)                                                   # [NV]
    xh = (xb * _f32((266 - ex) << 23)[:, None]).half()                     # x * 2^kx in fp16
    w = words_of(packed)                                                   # [R, NV, 4]
    acc_lo = torch.zeros(R, nv, dtype=torch.float16)
    acc_hi = torch.zeros(R, nv, dtype=torch.float16)
    for j in range(4):
        for k in range(4):
            if deq == "prmt":
                lo, hi = pb_pair_bits(w[..., j], k)
                cl, ch = PB_PAIRS[k]
            else:
                lo, hi = half_pair_bits(w[..., j], k)
                cl, ch = k, k + 4
            acc_lo = (lo.float() * xh[:, 8 * j + cl].float() + acc_lo.float()).half()
            acc_hi = (hi.float() * xh[:, 8 * j + ch].float() + acc_hi.float()).half()
    blk = acc_lo.float() + acc_hi.float()
    part = blk * _f32((scales.to(torch.int64) + 14) << 23) * _f32((ex - 12) << 23)[None, :]
    return _two_level_sum(part, q)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, lbeta: float) -> torch.Tensor:
    return beta * torch.tanh(g / beta) / (1.0 + torch.exp(-g)) * (lbeta * torch.tanh(u / lbeta))


def emulate_mxfp4_experts(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta,
                          bi: int = 8, bl: int = 64, groups_d: int = 8, math: str = "f32", mid: str = "f32",
                          deq: str | None = None):
    """The CuTe gate-up + down kernels on CPU: [N, K, L] in x.dtype (the op's contract); mid="bf16":
    the kernels that store gate-up's output (SiTU) rounded to bf16; deq: see rows_dot_h2 (default:
    the artifacts', build.MXFP4_DEQ: "prmt" for f16x2)."""
    deq = deq or ("prmt" if math == "f16x2" else "shift")
    N, K = topk_ids.shape
    L, I = x.shape[1], w13.shape[1] // 2
    nv_gu, nv_d = L // 32, I // 32
    assert 2 * bi <= nv_gu and bl <= nv_d * groups_d, "a CTA needs a thread per row"
    q_gu = reduction_q(nv_gu, 2 * bi, nv_gu)
    q_d = reduction_q(nv_d, bl, nv_d * groups_d)
    assert deq == "shift" or math == "f16x2", (deq, math)
    dot = functools.partial(rows_dot_h2, deq=deq) if math == "f16x2" else rows_dot
    out = torch.empty(N * K, L, dtype=torch.float32)
    ids = topk_ids.reshape(-1).tolist()
    for p, e in enumerate(ids):
        xt = x[p // K].float()
        h = torch.empty(I, dtype=torch.float32)
        for rb in range(I // bi):
            rows = torch.cat([torch.arange(rb * bi, rb * bi + bi), I + torch.arange(rb * bi, rb * bi + bi)])
            tot = dot(w13[e, rows], w13_scale[e, rows], xt, q_gu)
            h[rb * bi:(rb + 1) * bi] = situ(tot[:bi], tot[bi:], beta, linear_beta)
        if mid == "bf16":
            h = h.bfloat16().float()
        out[p] = dot(w2[e], w2_scale[e], h, q_d)
    return out.view(N, K, L).to(x.dtype)
