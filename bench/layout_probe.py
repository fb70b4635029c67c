"""Probe: does the weight layout limit the decode GEMMs' bandwidth? (one GPU, cold weights, graphed)

Every bf16 decode GEMM we have measured (cuBLAS, the Triton MMA/GEMV kernels, the CuTe wgmma+TMA
kernel) reads its weight at 71-83% of the read-only ceiling (a 2 GiB torch.sum), three independent
implementations landing at the same place. One reading: row-major weights streamed as [BN, BK]
tiles touch BN rows 2*K bytes apart at once, BK*2 contiguous bytes each. This probe times, per
weight shape at M=1, the same simple Triton kernel (one program per BN rows, the whole K in BK
steps, no split) over two layouts of the same bytes:
  rm     - the row-major weight [N, K];
  tiled  - the weight re-laid as [N/BN, K/BK, BN, BK] (every step one contiguous BN*BK*2 bytes);
each as a pure read (`read`: the tile summed, one value per program) and as the GEMV (`gemv`:
out = x @ w^T, checked against fp32), beside cuBLAS, k3's dispatch (kernels/gemm.gemm) and
torch.sum over the weight (read-only at this size). If `tiled` reads much faster than `rm`, a
pre-tiled weight layout for the decode GEMMs is worth building; if not, the layout is not the limit.

    python bench/layout_probe.py --out bench/results/layout_probe.json
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton
import triton.language as tl

SHAPES = {"latent": (3584, 7168), "latent_up": (7168, 3584), "router_latent": (4480, 7168),
          "oproj": (7168, 1536), "shared_gate_up": (1536, 7168)}
CONFIGS = [(bn, bk, nw, ns) for bn in (8, 16, 32) for bk in (256, 512, 1024) for nw in (4, 8) for ns in (3,)
           if bn * bk <= 16384]


@triton.jit
def probe_kernel(x, w, out, K, BN: tl.constexpr, BK: tl.constexpr, TILED: tl.constexpr, MATH: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], tl.float32)
    if TILED:
        base = w + pid * BN * K + rn[:, None] * BK + rk[None, :]
    else:
        base = w + (pid * BN + rn[:, None]) * K + rk[None, :]
    for k0 in range(0, K, BK):
        if TILED:
            t = tl.load(base + k0 * BN).to(tl.float32)
        else:
            t = tl.load(base + k0).to(tl.float32)
        if MATH:
            acc += t * tl.load(x + k0 + rk).to(tl.float32)[None, :]
        else:
            acc += t
    if MATH:
        tl.store(out + pid * BN + rn, tl.sum(acc, 1).to(out.dtype.element_ty))
    else:
        tl.store(out + pid, tl.sum(tl.sum(acc, 1), 0).to(out.dtype.element_ty))


def tiled(w, bn, bk):
    N, K = w.shape
    return w.view(N // bn, bn, K // bk, bk).permute(0, 2, 1, 3).contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from bench.common import BW_SEEN, hbm_bandwidth, save, time_graph
    from k3compile.kernels import gemm
    t0 = time.time()
    bw = hbm_bandwidth()
    g = torch.Generator("cuda").manual_seed(0)
    rows = []
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
        ncopy = max(2, -(-(200 << 20) // (N * K * 2)))
        copies = [w] + [w.clone() for _ in range(ncopy - 1)]
        x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
        ref = x.float() @ w.float().t()
        row = dict(shape=name, N=N, K=K, M=1, bytes=N * K * 2, floor_us=N * K * 2 / bw * 1e6, us={}, err={})
        nxt = itertools.cycle(copies).__next__
        row["us"]["cublas"] = time_graph(lambda: torch.mm(x, nxt().t()))
        row["us"]["k3"] = time_graph(lambda: gemm.gemm("bench", x, nxt()))
        row["us"]["torch_sum"] = time_graph(lambda: torch.sum(nxt(), dtype=torch.float32))
        for bn, bk, nw, ns in CONFIGS:
            if N % bn or K % bk:
                continue
            lay = {"rm": copies, "tiled": [tiled(c, bn, bk) for c in copies]}
            for lname, ws in lay.items():
                for math in (0, 1):
                    cyc = itertools.cycle(ws).__next__
                    out = torch.empty(N if math else N // bn, device="cuda",
                                      dtype=torch.bfloat16 if math else torch.float32)
                    key = f"{'gemv' if math else 'read'} {lname} {bn}/{bk}/{nw}/{ns}"

                    def fn(cyc=cyc, out=out, math=math, tiled_=lname == "tiled"):
                        probe_kernel[(N // bn,)](x, cyc(), out, K, BN=bn, BK=bk, TILED=tiled_, MATH=math,
                                                 num_warps=nw, num_stages=ns)
                    if math:
                        fn()
                        row["err"][key] = ((out.float() - ref[0]).abs().max() / ref.abs().max()).item()
                    row["us"][key] = time_graph(fn)
            del lay
        best = {p: min((v, k) for k, v in row["us"].items() if k.startswith(p))
                for p in ("read rm", "read tiled", "gemv rm", "gemv tiled")}
        row["best"] = {p: [k, round(v, 2), round(row["bytes"] / (v * 1e-6) / bw, 3)] for p, (v, k) in best.items()}
        for k in ("cublas", "k3", "torch_sum"):
            row["best"][k] = [k, round(row["us"][k], 2), round(row["bytes"] / (row["us"][k] * 1e-6) / bw, 3)]
        row["max_err"] = max(row["err"].values())
        rows.append(row)
        print(name, N, K, f"floor {row['floor_us']:.2f}", row["best"], f"max_err {row['max_err']:.1e}", flush=True)
        del copies, w
        torch.cuda.empty_cache()
        # saved after every shape: a run cut short keeps the shapes it finished
        save(a.out, dict(rows=rows, hbm_bytes_per_s=bw, bw_seen=BW_SEEN, gpu=torch.cuda.get_device_name(),
                         torch=torch.__version__, triton=triton.__version__), t0)


if __name__ == "__main__":
    main()
