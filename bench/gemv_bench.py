"""Decode GEMV: the Triton GEMV (kernels/triton_gemv.py) over a config sweep vs cuBLAS (torch.mm),
one GPU, cold weights (each captured call reads the next of enough weight copies to exceed the
L2), CUDA-graphed, per weight shape and M.

Shapes (N, K) are the bf16 GEMMs of the per-layer benchmark's ranks (tp8 = TP=8 per-rank widths
on 2 GPUs; tp2 = TP=2): the ones inside k3's ops (o-proj, router+latent shard, latent up-projection,
shared expert gate-up and down) and, for reference, the attention input projections the graph
leaves to cuBLAS. Each config's result must match fp32 x @ w.t() to 1e-2 relative or it is
dropped. Output: every config's time, the best per (shape, M) and its speed-up over cuBLAS.

    python bench/gemv_bench.py [--ms 1,4,8] [--out r.json]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import BW_SEEN, hbm_bandwidth, save, time_graph  # noqa: E402

SHAPES = {  # name: (N, K)
    "tp8 oproj": (7168, 1536), "tp8 router_shard": (2240, 7168), "tp8 latent_up": (3584, 3584),
    "tp8 shared_gate_up": (1536, 7168), "tp8 shared_down": (7168, 768), "tp8 in_proj_kda": (6284, 7168),
    "tp8 in_proj_mla": (3648, 7168), "tp2 oproj": (7168, 6144), "tp2 shared_gate_up": (6144, 7168),
    "tp2 shared_down": (7168, 3072),
}
CONFIGS = [(2, 1024, 4, 4), (4, 512, 4, 4), (4, 1024, 4, 3), (8, 256, 4, 4), (8, 512, 4, 3), (8, 512, 8, 4),
           (16, 256, 4, 4), (16, 256, 8, 3), (16, 512, 8, 3), (32, 128, 4, 4), (32, 256, 8, 3)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from k3compile.kernels import launch
    t0 = time.time()
    bw = hbm_bandwidth()
    g = torch.Generator("cuda").manual_seed(0)
    rows = []
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
        ncopy = max(2, -(-(200 << 20) // (N * K * 2)))
        nxt = itertools.cycle([w] + [w.clone() for _ in range(ncopy - 1)]).__next__
        for M in [int(m) for m in a.ms.split(",")]:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            ref = x.float() @ w.float().t()
            nbytes = (N * K + M * K + M * N) * 2
            row = dict(shape=name, N=N, K=K, M=M, bytes=nbytes, floor_us=nbytes / bw * 1e6, us={}, err={})
            variants = {"cublas": lambda: torch.mm(x, nxt().t())}
            for c in CONFIGS:
                variants["gemv %d/%d/%d/%d" % c] = (lambda c=c: launch.gemv(x, nxt(), cfg=c))
            for vn, fn in variants.items():
                try:
                    out = fn()
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    row["err"][vn] = f"{type(e).__name__}: {str(e)[:120]}"
                    continue
                row["err"][vn] = err
                if err < 1e-2:
                    row["us"][vn] = time_graph(fn)
            gem = {k: v for k, v in row["us"].items() if k.startswith("gemv")}
            best = min(gem, key=gem.get)
            row["best"], row["speedup_vs_cublas"] = best, row["us"]["cublas"] / gem[best]
            rows.append(row)
            print(f"{name:20s} M={M} cublas {row['us']['cublas']:6.2f} us  best {best} {gem[best]:6.2f} us "
                  f"(x{row['speedup_vs_cublas']:.2f}, {nbytes / gem[best] / 1e6:.2f} TB/s; floor "
                  f"{row['floor_us']:.2f})", flush=True)
    save(a.out, dict(rows=rows, hbm_bytes_per_s=bw, bw_seen=BW_SEEN, gpu=torch.cuda.get_device_name(),
                     torch=torch.__version__), t0)


if __name__ == "__main__":
    main()
