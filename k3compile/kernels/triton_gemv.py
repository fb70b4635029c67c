"""Triton GEMV for decode: out[M, N] = x[M, K] @ W[N, K]^T with M <= 8 (bf16/fp16/fp32).

At decode batch sizes a GEMM is a weight read: the cuBLAS kernels the graph gets read 10-30 MB
weights at 1.2-2.9 TB/s on an H200 (bench/layer_bench.py --attribute, BENCHMARKS.md), against
~4.4 TB/s the memory gives. This kernel is only a weight stream: each program owns BLOCK_N rows of W
and walks K in BLOCK_K steps (the loop is software-pipelined, `num_stages` loads in flight), the
M rows of x broadcast against the [BLOCK_N, BLOCK_K] weight tile on CUDA cores (no tensor cores:
at M <= 8 they would idle), fp32 accumulation, one store per output. No split-K: the grid is
N / BLOCK_N programs, so BLOCK_N is chosen per shape to fill the SMs (the tuned table in
launch.GEMV_TUNED, from bench/gemv_bench.py).

PDL=True (Programmatic Dependent Launch, Hopper; launched with `launch_pdl=True`): the weights never
depend on the previous kernel, so each program loads its first weight tile, then waits for the
previous kernel (`gdc_wait`) before it reads x, and lets the next kernel launch right away
(`gdc_launch_dependents`: the next one waits for this one's completion before reading what it
wrote). A chain of such GEMVs streams weights across kernel boundaries instead of ramping up and
draining each time, which a cuBLAS call cannot do. An experiment (`bench/gemv_bench.py --chain`),
not used by any op yet: it has not run on a GPU.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(x, w, out, M, N, K, sxm, swn, som, MP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ACC: tl.constexpr, PDL: tl.constexpr = False,
                GDC: tl.constexpr = False):
    """ACC: out += x @ W^T (out read, added in fp32, written), else out = x @ W^T. PDL: the first
    weight tile read before x (needs K >= BLOCK_K); GDC: with the grid-dependency wait / launch
    between them (the module docstring; off in Triton's CPU interpreter, which lacks them)."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, MP)
    nmask = rn < N
    acc = tl.zeros([MP, BLOCK_N], tl.float32)
    wp = w + rn.to(tl.int64)[:, None] * swn
    k_start = 0
    if PDL:
        rk = tl.arange(0, BLOCK_K)
        wt = tl.load(wp + rk[None, :], mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
        if GDC:
            tl.extra.cuda.gdc_wait()               # the previous kernel's writes (x, out) are visible now
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start streaming its weights
        xt = tl.load(x + rm[:, None] * sxm + rk[None, :], mask=rm[:, None] < M, other=0.0)
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
        acc += tl.sum(xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
    op = out + rm[:, None] * som + rn[None, :]
    om = (rm[:, None] < M) & nmask[None, :]
    if ACC:
        acc += tl.load(op, mask=om, other=0.0).to(tl.float32)
    tl.store(op, acc.to(out.dtype.element_ty), mask=om)
