"""MXFP4 routed-expert GEMV for decode on sm_90a (CuTe DSL): gate-up (SiTU fused) and down.

Contract (the same as triton_moe's kernels, one CTA per (token, slot) pair p and row block):
  gate_up: mid[p] = SiTU(W13[e] @ x[t])    [P, I] fp32, or bf16 (mid="bf16")  (t = p // K, e = ids[p])
  down:    out[p] = W2[e] @ mid[p]         bf16 [P, L]    (unweighted, unfinalised)
Weights: packed E2M1 codes, two per byte, low nibble first ([E, rows, KB] uint8, KB = K_in / 2),
E8M0 scales [E, rows, K_in / 32] uint8 (value = code * 2^(s - 127)).

Design (CUDA cores, bound by the weight bytes; no tensor cores, no shared-memory weight tiles):
- One 16-byte vector of a weight row = 32 codes = exactly one scale block. A CTA has T = G * NV
  threads, NV = K_in / 32 vectors per row: thread t owns vector v = t % NV of every row it reads
  and row group g = t // NV; it reads rows g, g + G, ... (RPG rows), so a group's NV threads read
  one row's bytes contiguously and consecutive groups consecutive rows (fully coalesced).
- The thread's 32 activations (x[t, 32v:32v+32] as bf16, or mid's for down) are loaded once,
  converted to fp32 and pre-scaled by 2^100 (exact), and kept in registers for all its rows.
- wload="cp": all RPG rows' 16-byte vectors and the CTA's scale bytes are issued before any math, as
  cp.async into shared memory (`stages` commit groups): RPG * 16 bytes in flight per thread (gate-up
  TP=8: 16 rows -> 28 KB per CTA). wload="ldg" (the "ldgd" kernels dispatch takes at up to 16
  tokens, moe.mxfp4_tag): the vectors go into registers, one stage of rows ahead of the stage
  being summed, so the sums overlap the loads instead of following most of them (Nsight Compute,
  TP=8 M=1, cp.async gate-up: DRAM 37%, 0.39 issued warps per scheduler cycle; probes:
  that gate-up takes 11.2 us, its loads alone 8.3, its math alone 7.8; the ldg one 8.9).
- Dequantisation two codes per 3 integer ops (v3's trick): for a word w (8 codes, code j in nibble
  j) and k in 0..3, n = (k < 2 ? w : w >> 8) & (k even ? 0x000F000F : 0x00F000F0);
  m = n * (k even ? 2^6 + 2^12 : 2^2 + 2^8) puts codes (k, k + 4) as two bf16 bit patterns
  ((c & 7) << 6) | ((c & 8) << 12) = value(c) * 2^-126 in m's halves (bits outside the masks are
  garbage, never carried into the kept bits). The high code's fp32 is m & 0x81C00000 (a bf16 in
  the high half *is* an fp32), the low one's (m << 16) & 0x81C00000: 5 integer ops per code pair,
  then two fp32 FMAs (fma.rn.f32, no .ftz: +-0.5 * 2^-126 is an fp32 subnormal input, and with x
  pre-scaled by 2^100 every product value * x * 2^-26 is normal).
- Per row: the 32-code block sum (in the 2^-26 domain) times the block scale 2^(s - 127 + 26),
  built from its fp32 bits (s + 26) << 23 (exact for s <= 228, i.e. weights < 2^103).
- Reduction: per-thread row partials -> shared memory [R, NV] (over the staged weights, after a
  barrier: 32 KB per gate-up CTA, 7 CTAs per SM, so M=1's 768 CTAs are one wave), then Q threads per row sum NV / Q
  partials each, then one thread per row sums the Q results; the epilogue (SiTU of gate row i and
  up row i; bf16 rounding for down) stores one value per row.
- math="f16x2" (the "_h2" artifacts): codes as f16x2 patterns ((c & 7) << 9) | ((c & 8) << 12) =
  value * 2^-14. deq="prmt" (the default, measured: median 1.06x the "shift" kernels over
  TP=8 / TP=2, M = 1..64, graphed, 0.97-1.28x; SASS 1600 instead of 1856 instructions per gate-up thread): the patterns' high bytes
  of a word's even and of its odd codes, 4 at a time (7 integer ops per word), then one byte
  permute per pair, 2.75 ops per pair (see PB_PAIRS); deq="shift" (the "sh" alternate): 3.75 ops
  per pair (mask, shift, shifted sign, LOP3 merge), pairs (k, k + 4). The thread's 32
  activations times a power of two 2^kx with max |x| * 2^kx in [2^12, 2^13) (from the exponent
  of max |x|, exact), packed once as f16x2 in the dequantisation's pairs; one fma.rn.f16x2 per pair into
  an f16x2 block accumulator (|products| <= 3, block sums <= 48: no overflow; products of
  x < 2^-26 max |x| become fp16 subnormals, negligible against the block); the two halves summed
  in fp32 and scaled by 2^(s - 127 + 14) * 2^-kx. SASS (gate-up, TP=8): 6.25 instructions per
  weight byte over the whole kernel (shift: 7.25, f32: 9.25); error vs the fp32 reference ~6e-3 of max |out| on CPU emulation (f32: 0).
- Programmatic Dependent Launch (Hopper): the gate-up kernel executes
  `griddepcontrol.launch_dependents` once its weight bytes are in flight, and the down kernel
  issues its own weight and scale loads, then `griddepcontrol.wait`s before it reads mid. The
  loader launches down with programmatic stream serialisation (manifest "pdl": "wait") unless
  K3_KNOBS=cute_pdl=0 (`moe.cute_pdl`: measured faster or equal at every batch), so its CTAs start and
  fetch weights while gate-up drains instead of after it; without the attribute both instructions
  are no-ops.
- Options: mid="bf16" (the f16x2 artifacts' default) stores gate-up's output as bf16, and down
  reads 64 bytes of it per thread instead of 128: every down CTA re-reads its pairs' mid rows
  (as many bytes as its weights with fp32), and Nsight Compute showed down's L1 at 84% of its
  throughput and its DRAM at 50% at TP=8 M=16 (64% with bf16; 4-15% faster graphed);
  x_first emits gate-up's activation loads, ordered, ahead of its weights (in the default they
  are pure asm and the SASS issues them after the first cp.async wait, so their latency follows
  that stage's; with x_first ptxas still schedules them after the weights' cp.async, but before
  the first wait).
`emulate_mxfp4_experts` in `k3compile.kernels.cute.mxfp4_ref` reproduces the bit tricks and this summation
order in PyTorch (CPU-tested against `k3compile.model.mxfp4`).

Kernel parameters are raw device addresses (u64), i32 and f32 scalars; the loader fills them
from the manifest (`build.py`). The DSL is imported by whoever imports this module.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cutlass_dsl import T, dsl_user_op

from .ptx import (_asm, as_f32, as_i32, cp_async4, cp_async16, cp_async_commit, cp_async_wait, fma, ld_s32,
                  ld_v4_dep, ld_v4_keep, ld_v4_ordered, lds_u8, lds_v4, pdl_trigger, pdl_wait, st_bf16, st_f32)

PRESCALE = 1.2676506002282294e30   # 2^100
_PAIR_MASK = (0x000F000F, 0x00F000F0)   # nibbles (k, k + 4) of a word, k even / odd
_PAIR_MUL = (4160, 260)                # 2^6 + 2^12 / 2^2 + 2^8: magnitude to bits 6..8, sign to 15
SCALE_BIAS = 26                    # 2^(s - 127) * 2^126 / 2^100 = 2^(s - 101): bits (s + 26) << 23


@dsl_user_op
def bits_to_f32_hi(w: Int32, *, loc=None, ip=None) -> Float32:
    """The bf16 in the high half of w as fp32."""
    return as_f32(w & Int32(-65536), loc=loc, ip=ip)


@cute.jit
def _block_dot(words, xs):
    """sum_k value(code k) * 2^-126 * xs[k] over the 32 codes of 4 words (fp32 FMAs; the order the
    emulation in mxfp4_ref reproduces: per word j, k = 0..3: code 8j+k+4 then code 8j+k)."""
    acc = Float32(0.0)
    for j in cutlass.range_constexpr(4):
        w = words[j]
        w8 = w >> 8
        srcs = [w, w, w8, w8]
        for k in cutlass.range_constexpr(4):
            m = (srcs[k] & Int32(_PAIR_MASK[k % 2])) * Int32(_PAIR_MUL[k % 2])
            hi = as_f32(m & Int32(-2118123520))             # 0x81C00000
            lo = as_f32((m << 16) & Int32(-2118123520))
            acc = fma(hi, xs[8 * j + k + 4], acc)
            acc = fma(lo, xs[8 * j + k], acc)
    return acc


# ---- half2 math (math="f16x2"), deq="shift": 3.75 integer ops per code pair + one fma.rn.f16x2
_H_MAG = ((0x00070007, 9), (0x00700070, 5), (0x07000700, 1), (0x70007000, -3))   # mask, left shift
_H_SIGN = (12, 8, 4, 0)                                                          # sign bit -> 15 / 31
H_SCALE_BIAS = 14    # code pattern = value * 2^-14: block scale 2^(s - 127) * 2^14 = bits (s + 14) << 23
H_TARGET_EXP = 139   # x * 2^k with k = 139 - exponent(max |x|): the thread's max |x| in [2^12, 2^13)
H_MIN_EXP = 20       # exponent floor for all-zero / tiny blocks (keeps 2^k and 2^-k normal fp32)


@dsl_user_op
def hfma2(a: Int32, b: Int32, c: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip),
                                Int32(c).ir_value(loc=loc, ip=ip)], "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r"))


@dsl_user_op
def f32x2_to_f16x2(hi: Float32, lo: Float32, *, loc=None, ip=None) -> Int32:
    """{hi, lo} rounded to fp16, hi in the upper half."""
    return Int32(_asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                      "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f"))


@dsl_user_op
def f16x2_sum(a: Int32, *, loc=None, ip=None) -> Float32:
    """float(lo half) + float(hi half) of an f16x2 register, in fp32."""
    return Float32(_asm(T.f32(), [Int32(a).ir_value(loc=loc, ip=ip)],
                        "{ .reg .b16 l, h; .reg .f32 a, b; mov.b32 {l, h}, $1; cvt.f32.f16 a, l; "
                        "cvt.f32.f16 b, h; add.f32 $0, a, b; }", "=f,r"))


@dsl_user_op
def imax(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
                      "max.s32 $0, $1, $2;", "=r,r,r"))


@cute.jit
def _half_pair(w, k: cutlass.Constexpr):
    """Codes (8j+k, 8j+k+4) of word w as an f16x2 of value * 2^-14 (low half: code 8j+k):
    ((c & 7) << 9) | ((c & 8) << 12) per half; the masks keep the halves apart."""
    mask, sh = _H_MAG[k]
    n = w & Int32(mask)
    mag = (n << sh) if sh > 0 else (n >> -sh)       # n has bit 31 clear: >> is exact
    sgn = (w << _H_SIGN[k]) if _H_SIGN[k] > 0 else w
    return mag | (sgn & Int32(-2147450880))            # 0x80008000


# ---- deq="prmt": the high bytes of the f16 patterns of a word's 8 codes, 4 at a time, then one
# byte permute per pair (2.75 integer ops per pair instead of 3.75). H(c) = ((c & 7) << 1) |
# ((c & 8) << 4) is the high byte of ((c & 7) << 9) | ((c & 8) << 12) (its low byte is 0):
#   E = ((w << 1) & 0x0E0E0E0E) | ((w << 4) & 0x80808080)   byte i = H(code 2i)      (4 ops)
#   O = ((w >> 3) & 0x0E0E0E0E) | (w & 0x80808080)          byte i = H(code 2i + 1)  (3 ops)
# prmt(E or O, 0, sel) puts two of those bytes in the high bytes of the halves, zeros below.
# Pairs per word, (low half code, high half code), in accumulation order:
PB_PAIRS = ((0, 2), (4, 6), (1, 3), (5, 7))
_PB_SEL = (0x1404, 0x3424)          # bytes (0, 1) / (2, 3) of the first operand -> bytes 1, 3; 4 = zero


@dsl_user_op
def prmt_hi(a: Int32, sel: int, *, loc=None, ip=None) -> Int32:
    """prmt.b32 d, a, 0, sel: bytes of a (selector nibbles 0-3) or zero bytes (4)."""
    return Int32(_asm(T.i32(), [Int32(a).ir_value(loc=loc, ip=ip)],
                      "{ .reg .b32 z; mov.b32 z, 0; prmt.b32 $0, $1, z, " + hex(sel) + "; }", "=r,r"))


@cute.jit
def _block_dot_h2(words, xh, deq: cutlass.Constexpr = "shift"):
    """f16x2 sum over the 32 codes of 4 words, returns lo + hi in fp32 (value * 2^-14 * x * 2^kx).
    deq "shift": acc = fma(pair(j, k), xh[4j+k], acc), j, k = 0..3 (codes 8j+k, 8j+k+4);
    deq "prmt": the pairs PB_PAIRS of word j, in order, with xh[4j+i] built to match."""
    acc = Int32(0)
    for j in cutlass.range_constexpr(4):
        if cutlass.const_expr(deq == "prmt"):
            w = words[j]
            ev = ((w << 1) & Int32(0x0E0E0E0E)) | ((w << 4) & Int32(-2139062144))        # 0x80808080
            od = ((w >> 3) & Int32(0x0E0E0E0E)) | (w & Int32(-2139062144))               # >>: masked
            srcs = (ev, ev, od, od)
            for i in cutlass.range_constexpr(4):
                acc = hfma2(prmt_hi(srcs[i], _PB_SEL[i % 2]), xh[4 * j + i], acc)
        else:
            for k in cutlass.range_constexpr(4):
                acc = hfma2(_half_pair(words[j], k), xh[4 * j + k], acc)
    return f16x2_sum(acc)


class Mxfp4ExpertGemvSm90:
    """mode "gate_up": rows 2*BI per CTA (BI gate rows, the same BI up rows), K_in = L;
    mode "down": rows G*RPG per CTA, K_in = I. NV = K_in / 32 vectors (scale blocks) per row.
    stages: the rows a thread reads are split into this many stages, consumed in order: cp.async
    commit groups (wload "cp"; the first also carries the CTA's scale bytes) or register loads
    issued one stage ahead (wload "ldg").
    wload: "cp" (every row's vector staged in shared memory by cp.async, all in flight before any
    math) or "ldg" (vectors loaded into registers, one stage of rows in flight ahead of the stage
    being summed; shared memory holds only scales and partials). With "cp" a warp sums nothing
    until its first stage is in, and at one CTA wave the sums of most rows come after most bytes
    arrived; with "ldg" they overlap the loads (gate-up alone, TP=8 M=1: 8.9 instead of 11.1 us).
    In down, ptxas moves the register loads below griddepcontrol.wait: with PDL its weights are
    then fetched after gate-up ends, not before (an L2 prefetch issued before the wait measured
    slower; so did coherent loads, which ptxas keeps above the wait: tags ldgde / ldgde1,
    1-4% slower at TP=8).
    probe (benchmarks only, wrong results): "nomath" replaces each block's dot by an XOR of its
    words (what the loads alone cost), "noload" skips the weight loads (what the math alone costs)."""

    def __init__(self, mode: str, I: int, L: int, K: int, rows: int, groups: int = 1, stages: int = 4,
                 math: str = "f32", mid: str = "f32", x_first: bool = False, deq: str = "shift",
                 wload: str = "cp", probe: str = ""):
        assert mode in ("gate_up", "down"), mode
        assert wload in ("cp", "ldg"), wload
        assert probe in ("", "nomath", "noload"), probe
        self.ldg, self.probe = wload == "ldg", probe
        assert deq in ("shift", "prmt") and (deq == "shift" or math == "f16x2"), (deq, math)
        self.deq = deq
        assert math in ("f32", "f16x2"), math
        assert mid in ("f32", "bf16"), mid
        self.half = math == "f16x2"
        self.mid_bf16 = mid == "bf16"             # mid (gate-up's output, down's input) stored as bf16
        self.x_first = x_first and mode == "gate_up"   # down's activations exist only after pdl_wait
        self.mode, self.I, self.L, self.K = mode, I, L, K
        k_in = L if mode == "gate_up" else I
        assert k_in % 128 == 0, "NV = K_in / 32 scale bytes per row must be a multiple of 4 (cp.async 4 B)"
        self.nv = k_in // 32
        self.kb = k_in // 2                       # bytes per weight row
        self.g = groups
        self.threads = self.g * self.nv
        assert self.threads <= 1024, self.threads
        if mode == "gate_up":
            assert I % rows == 0 and groups == 1
            self.bi = rows
            self.r = 2 * rows
            self.runs = 2                         # scale bytes: the gate rows' run and the up rows' run
        else:
            assert L % rows == 0
            self.r = rows
            self.runs = 1
        assert self.r % self.g == 0 and self.r <= self.threads, (self.r, self.g, self.threads)
        self.rpg = self.r // self.g
        assert self.rpg % stages == 0, (self.rpg, stages)
        self.stages = stages
        self.run_chunks = self.r // self.runs * self.nv // 4      # 4-byte chunks of scales per run
        # level-1 reduction: Q threads per row, each summing NV / Q partials
        self.q = max(d for d in range(1, self.nv + 1) if self.nv % d == 0 and self.r * d <= self.threads)
        self.row_blocks = (I // rows) if mode == "gate_up" else (L // rows)
        # dynamic shared memory: the fields below with their alignment, + 1 KiB for the allocator
        self.wbuf_words = self.r * self.nv if self.ldg else self.rpg * self.threads * 4
        self.smem_bytes = (self.wbuf_words * 4 + _up(self.r * self.nv, 16)
                           + 4 * (self.r * self.q + self.r) + 64 + 1024)

    @cute.jit
    def __call__(self, x: Int64, ids: Int64, w: Int64, s: Int64, out: Int64, P: Int32, beta: Float32,
                 lbeta: Float32, stream: cuda.CUstream):
        @cute.struct
        class Smem:
            # the staged weight vectors; after the math (and a barrier) the row partials [R, NV]
            # (wload "ldg": the partials only)
            wbuf: cute.struct.Align[cute.struct.MemRange[Float32, self.wbuf_words], 16]
            sbuf: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.r * self.nv], 16]
            part2: cute.struct.MemRange[Float32, self.r * self.q]
            tot: cute.struct.MemRange[Float32, self.r]
        self.smem_t = Smem
        self.kernel(x, ids, w, s, out, beta, lbeta).launch(
            grid=(P, self.row_blocks, 1), block=(self.threads, 1, 1), stream=stream,
            # .minnctapersm 1: with .reqntid alone ptxas capped the f16x2 gate-up at 48 registers and
            # spilled; (> 1 would make the DSL query a device for its shared memory size)
            min_blocks_per_mp=1)

    def _row(self, rb, g, r):
        """Weight row of the thread's r-th row (gate-up: G == 1, local row r, gate then up)."""
        if self.mode == "gate_up":
            return Int64(rb * self.bi + (r if r < self.bi else r - self.bi + self.I))
        return Int64(rb * self.r + g + r * self.g)

    def _load_row(self, wbase, rb, g, r):
        """wload "ldg": the thread's 16-byte vector of its r-th row, into registers (ordered: emitted
        where the stage schedule puts it); probe "noload": constant words instead."""
        if self.probe == "noload":
            return [Int32(0x12345678 + i) for i in range(4)]
        return ld_v4_ordered(wbase + self._row(rb, g, r) * self.kb)

    def _load_x_words(self, x, p, v):
        """This thread's 32 activations as raw 32-bit words (16 words of bf16 pairs: x[t] for gate-up,
        or a bf16 mid; 32 fp32 words: an fp32 mid), emitted at trace time where it is called.
        Down reads mid, which gate-up wrote, with coherent ordered loads (ld_v4_dep) after pdl_wait.
        Gate-up reads x through the non-coherent path: pure asm by default (the compiler sinks it
        to its first use, past the first cp.async wait), ordered with x_first (issued before it)."""
        if self.mode == "gate_up":
            xa = x + (Int64(p // self.K) * self.L + Int64(v) * 32) * 2
            n = 4
        else:
            xa = x + (Int64(p) * self.I + Int64(v) * 32) * (2 if self.mid_bf16 else 4)
            n = 4 if self.mid_bf16 else 8
        words = []
        for i in range(n):
            if self.mode == "down":      # written by gate-up, which PDL may still be running: see ld_v4_dep
                words += ld_v4_dep(xa + 16 * i)
            else:
                words += ld_v4_keep(xa + 16 * i, self.x_first)
        return words

    @cute.kernel
    def kernel(self, x: Int64, ids: Int64, w: Int64, s: Int64, out: Int64, beta: Float32, lbeta: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        p, rb, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_t)
        part = st.wbuf.get_tensor(cute.make_layout((self.r, self.nv), stride=(self.nv, 1)))
        part2 = st.part2.get_tensor(cute.make_layout((self.r, self.q), stride=(self.q, 1)))
        tot = st.tot.get_tensor(cute.make_layout(self.r))
        wsm = st.wbuf.data_ptr().toint() + tidx * 16          # this thread's slot of row-stage 0
        ssm = st.sbuf.data_ptr().toint()

        v = tidx % self.nv
        g = tidx // self.nv
        e = Int64(ld_s32(ids + Int64(p) * 4))
        n_rows = 2 * self.I if self.mode == "gate_up" else self.L
        wbase = w + e * (n_rows * self.kb) + Int64(v) * 16
        sexp = s + e * (n_rows * self.nv)

        # scales of the CTA's rows (cp.async 4 B chunks, contiguous runs), then every row's 16-byte
        # vector in `stages` commit groups: all bytes in flight before any math
        for run in cutlass.range_constexpr(self.runs):
            row0 = rb * (self.bi if self.mode == "gate_up" else self.r) + (self.I if run == 1 else 0)
            for c in cutlass.range_constexpr((self.run_chunks + self.threads - 1) // self.threads):
                idx = tidx + c * self.threads
                if idx < self.run_chunks:
                    cp_async4(ssm + run * self.run_chunks * 4 + idx * 4, sexp + Int64(row0) * self.nv + Int64(idx) * 4)
        per = self.rpg // self.stages
        xw = []
        if cutlass.const_expr(self.x_first):
            xw = self._load_x_words(x, p, v)                 # in flight with (and ahead of) the weights
        regs = [None] * self.rpg                             # wload "ldg": the rows' words in registers
        if cutlass.const_expr(self.ldg):
            cp_async_commit()                                # the scales: group 0
            for r in cutlass.range_constexpr(per):           # stage 0 in flight
                regs[r] = self._load_row(wbase, rb, g, r)
        else:
            for r in cutlass.range_constexpr(self.rpg):
                if cutlass.const_expr(self.probe != "noload"):
                    cp_async16(wsm + r * self.threads * 16, wbase + self._row(rb, g, r) * self.kb)
                if cutlass.const_expr(r % per == per - 1):
                    cp_async_commit()
        if cutlass.const_expr(self.mode == "gate_up"):
            pdl_trigger()      # weight bytes are in flight: the down kernel may start its own weight loads
        else:
            pdl_wait()         # the weights are in flight; mid (the gate-up kernel's output) is read below

        # activations: 32 values of this thread's block, fp32, pre-scaled by 2^100 (f32 math; f16x2
        # scales them below)
        pre = Float32(1.0 if self.half else PRESCALE)
        xs = []
        if cutlass.const_expr(not self.x_first):
            xw = self._load_x_words(x, p, v)
        if cutlass.const_expr(self.mode == "gate_up" or self.mid_bf16):   # bf16 pairs in each word
            for i in cutlass.range_constexpr(16):
                xs.append(as_f32(xw[i] << 16) * pre)
                xs.append(bits_to_f32_hi(xw[i]) * pre)
        else:
            for i in cutlass.range_constexpr(32):
                xs.append(as_f32(xw[i]) * pre)

        xh = []
        inv = Float32(1.0)
        if cutlass.const_expr(self.half):
            # per-thread power of two 2^kx: max |x| * 2^kx in [2^12, 2^13) (exact in fp32), then f16x2
            # pairs (x[8j+k] low, x[8j+k+4] high) in the order of the code pairs
            amax = Int32(0)
            for i in cutlass.range_constexpr(32):
                amax = imax(amax, as_i32(xs[i]) & Int32(0x7FFFFFFF))
            ex = imax(amax >> 23, Int32(H_MIN_EXP))
            xup = as_f32((Int32(H_TARGET_EXP + 127) - ex) << 23)         # 2^kx, kx = 139 - ex
            inv = as_f32((ex - Int32(H_TARGET_EXP - 127)) << 23)         # 2^-kx
            for j in cutlass.range_constexpr(4):
                for k in cutlass.range_constexpr(4):
                    lo, hi = PB_PAIRS[k] if cutlass.const_expr(self.deq == "prmt") else (k, k + 4)
                    xh.append(f32x2_to_f16x2(xs[8 * j + hi] * xup, xs[8 * j + lo] * xup))
        sums = []
        for r in cutlass.range_constexpr(self.rpg):
            if cutlass.const_expr(self.ldg):
                if cutlass.const_expr(r == 0):
                    cp_async_wait(0)
                    cute.arch.sync_threads()                   # the scale bytes other threads loaded
                if cutlass.const_expr(r % per == 0 and r + per < self.rpg):
                    for r2 in cutlass.range_constexpr(r + per, r + 2 * per):   # the next stage in flight
                        regs[r2] = self._load_row(wbase, rb, g, r2)
            elif cutlass.const_expr(r % per == 0):
                cp_async_wait(self.stages - 1 - r // per)
                if cutlass.const_expr(r == 0):
                    cute.arch.sync_threads()                   # the scale bytes other threads loaded
            lr = r if cutlass.const_expr(self.mode == "gate_up") else g + r * self.g
            sc = lds_u8(ssm + lr * self.nv + v)
            words = regs[r] if cutlass.const_expr(self.ldg) else lds_v4(wsm + r * self.threads * 16)
            if cutlass.const_expr(self.probe == "nomath"):
                blk = as_f32((words[0] ^ words[1] ^ words[2] ^ words[3]) & Int32(0x3FFFFFFF))
            elif cutlass.const_expr(self.half):
                blk = _block_dot_h2(words, xh, self.deq)
            else:
                blk = _block_dot(words, xs)
            if cutlass.const_expr(self.half):
                sums.append(blk * as_f32((sc + H_SCALE_BIAS) << 23) * inv)
            else:
                sums.append(blk * as_f32((sc + SCALE_BIAS) << 23))
            if cutlass.const_expr(self.ldg):
                part[lr, v] = sums[r]                          # wbuf holds only the partials
        if cutlass.const_expr(not self.ldg):
            cute.arch.sync_threads()                           # every thread is done with wbuf
            for r in cutlass.range_constexpr(self.rpg):
                lr = r if cutlass.const_expr(self.mode == "gate_up") else g + r * self.g
                part[lr, v] = sums[r]
        cute.arch.sync_threads()

        if tidx < self.r * self.q:
            rr = tidx // self.q
            c0 = (tidx % self.q) * (self.nv // self.q)
            a = Float32(0.0)
            for c in cutlass.range_constexpr(self.nv // self.q):
                a = a + part[rr, c0 + c]
            part2[rr, tidx % self.q] = a
        cute.arch.sync_threads()
        if tidx < self.r:
            a = Float32(0.0)
            for c in cutlass.range_constexpr(self.q):
                a = a + part2[tidx, c]
            tot[tidx] = a
        cute.arch.sync_threads()

        if cutlass.const_expr(self.mode == "gate_up"):
            if tidx < self.bi:
                gt = tot[tidx]
                up = tot[tidx + self.bi]
                gs = beta * cute.math.tanh(gt / beta) / (Float32(1.0) + cute.math.exp(-gt))
                us = lbeta * cute.math.tanh(up / lbeta)
                if cutlass.const_expr(self.mid_bf16):
                    st_bf16(out + (Int64(p) * self.I + Int64(rb * self.bi + tidx)) * 2, gs * us)
                else:
                    st_f32(out + (Int64(p) * self.I + Int64(rb * self.bi + tidx)) * 4, gs * us)
        else:
            if tidx < self.r:
                st_bf16(out + (Int64(p) * self.L + Int64(rb * self.r + tidx)) * 2, tot[tidx])


def _up(n: int, a: int) -> int:
    return (n + a - 1) // a * a
