"""CuTe skinny GEMM (AOT cubin, driver launch) vs cuBLAS (torch.mm) vs Triton (tl.dot), one GPU.

The o-proj / up-projection GEMM shapes of a rank: N = 7168 (hidden), K = 1536 (TP=8 heads) or
6144 (TP=2), bf16, M in {1, 4, 16, 64}. Every variant is captured in a CUDA graph (R calls per
graph, CUDA events, median per call, as ops_bench) on the same random data, and checked against
fp32 `x @ w.t()` (max abs error / max |ref|). The CuTe artifact used for M is the smallest tile
that covers it (`loader.find`), as dispatch does. Bytes = the weight (N*K*2) + x + out; floor =
bytes / measured HBM bandwidth.

    K3_CUTE_DIR=build/cute python bench/cute_bench.py [--ms 1,4,16,64] [--out r.json]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import BW_SEEN, hbm_bandwidth, save, time_graph  # noqa: E402

N = 7168


def _triton_gemm():
    import triton
    import triton.language as tl

    @triton.jit
    def k(x, w, o, M, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        n0 = tl.program_id(0) * BN
        rm = tl.arange(0, BM)
        rn = n0 + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(x + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
            b = tl.load(w + rn[None, :] * K + rk[:, None])
            acc = tl.dot(a, b, acc)
        tl.store(o + rm[:, None] * N + rn[None, :], acc.to(o.dtype.element_ty), mask=rm[:, None] < M)

    def run(x, w):
        import torch
        M, K = x.shape
        out = torch.empty(M, w.shape[0], device=x.device, dtype=x.dtype)
        BM = max(16, triton.next_power_of_2(M))
        k[(w.shape[0] // 64,)](x, w, out, M, w.shape[0], K, BM=BM, BN=64, BK=128, num_warps=4, num_stages=4)
        return out
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--rotate", type=int, default=1,
                    help="cycle through this many weight copies (> 60 MB L2 in all: cold weights, as in a model)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from k3compile.kernels.cute import loader
    from k3compile.kernels.cute.build import default_dir
    bw = hbm_bandwidth()
    tri = _triton_gemm()
    rows = []
    g = torch.Generator("cuda").manual_seed(0)
    for shape, K in (("tp8", 1536), ("tp2", 6144)):
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
        copies = [w] + [w.clone() for _ in range(a.rotate - 1)]
        nxt = itertools.cycle(copies).__next__  # each captured call reads the next copy
        for M in [int(m) for m in a.ms.split(",")]:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            ref = x.float() @ w.float().t()
            nbytes = (N * K + M * K + M * N) * 2
            row = dict(shapes=shape, rotate=a.rotate, M=M, N=N, K=K, bytes=nbytes, floor_us=nbytes / bw * 1e6, us={}, err={})
            art, why = loader.find(default_dir(), "oproj_gemm", N, K, M)
            variants = {"cublas": lambda: torch.mm(x, nxt().t()), "triton": lambda: tri(x, nxt())}
            if art is not None:
                row["cute_artifact"] = art.path.stem
                variants["cute"] = lambda: art.launch_gemm(x, nxt())
            else:
                row["cute_missing"] = why
            for name, fn in variants.items():
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    row["err"][name] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    row["us"][name] = time_graph(fn)
                except Exception as e:  # noqa: BLE001 - record and go on to the next variant
                    row["err"][name] = f"{type(e).__name__}: {e}"
            us = row["us"]
            if "cute" in us:
                row["cute_vs_cublas"] = us["cublas"] / us["cute"]
                row["cute_vs_triton"] = us.get("triton", float("nan")) / us["cute"]
            rows.append(row)
            print(f"gemm {shape} rotate={a.rotate} M={M:<3} " + " ".join(f"{k}={v:7.2f}us" for k, v in us.items())
                  + f" floor={row['floor_us']:.2f}us err={row['err']}", flush=True)
    save(a.out, dict(rows=rows, hbm_bytes_per_s=bw, bw_seen=BW_SEEN, gpu=torch.cuda.get_device_name(),
                     torch=torch.__version__))

if __name__ == "__main__":
    main()
