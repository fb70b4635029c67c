"""Decode GEMV: the Triton GEMV (kernels/triton_gemv.py) over a config sweep vs cuBLAS (torch.mm),
one GPU, cold weights (each captured call reads the next of enough weight copies to exceed the
L2), CUDA-graphed, per weight shape and M.

Shapes (N, K) are the bf16 GEMMs of the per-layer benchmark's ranks (tp8 = TP=8 per-rank widths
on 2 GPUs; tp2 = TP=2): the ones inside k3's ops (o-proj, router+latent shard, latent up-projection,
shared expert gate-up and down) and, for reference, the attention input projections the graph
leaves to cuBLAS. Each config's result must match fp32 x @ w.t() to 1e-2 relative or it is
dropped. Output: every config's time, the best per (shape, M) and its speed-up over cuBLAS.

    python bench/gemv_bench.py [--ms 1,4,8] [--out r.json]

--chain SWEEP.json: instead, the six GEMMs of a KDA decode step at TP=8 shapes back to back in one
CUDA graph (cold weights), three ways: cuBLAS; the Triton GEMV with each shape's best config from
that sweep; and the same GEMV with Programmatic Dependent Launch (each kernel reads its first
weight tile before waiting for the previous one: kernels/triton_gemv.py). A cuBLAS call at M=1 spends
~3 us it does not stream weights (the sweep: 11 MB in 5.7 us, 22 MB in 8.3 us); this measures how
much of that a PDL chain hides.

    python bench/gemv_bench.py --chain bench/results/gemv_sweep_h200x2_e2f234a.json --ms 1,4 --out r.json
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


# a KDA decode step's GEMMs in order, TP=8 shapes (the attention input projection, o-proj, the
# sharded router + latent rows, the shared expert, the latent up-projection)
CHAIN = ("tp8 in_proj_kda", "tp8 oproj", "tp8 router_shard", "tp8 shared_gate_up", "tp8 shared_down", "tp8 latent_up")


def chain_cfg(sweep: dict, shape: str, M: int, K: int) -> tuple[int, int, int, int]:
    """The sweep's best GEMV config for (shape, M) (the nearest M above if not swept), with BLOCK_K
    capped at K (the PDL GEMV reads one full tile before it waits)."""
    ms = sorted(m for (s, m) in sweep if s == shape)
    m = next((x for x in ms if x >= M), ms[-1])
    bn, bk, nw, ns = sweep[(shape, m)]
    while bk > K:
        bk //= 2
    return bn, bk, nw, ns


def chain(a, ms, bw):
    import json

    import torch

    from k3compile.kernels import launch
    sweep = {(r["shape"], r["M"]): tuple(int(v) for v in r["best"].split()[1].split("/"))
             for r in json.load(open(a.chain))["rows"]}
    g = torch.Generator("cuda").manual_seed(0)
    ws, rows = {}, []
    for name in CHAIN:
        N, K = SHAPES[name]
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
        # enough copies that the chain's weights exceed the L2 several times over: every call reads HBM
        ncopy = max(2, -(-(120 << 20) // (N * K * 2)))
        ws[name] = [w] + [w.clone() for _ in range(ncopy - 1)]
    for M in ms:
        xs = {n: torch.randn(M, SHAPES[n][1], device="cuda", generator=g).bfloat16() for n in CHAIN}
        outs = {n: torch.empty(M, SHAPES[n][0], device="cuda", dtype=torch.bfloat16) for n in CHAIN}
        refs = {n: xs[n].float() @ ws[n][0].float().t() for n in CHAIN}
        cfgs = {n: chain_cfg(sweep, n, M, SHAPES[n][1]) for n in CHAIN}
        step = {"i": 0}

        def run(kind):
            i = step["i"]
            step["i"] += 1
            for n in CHAIN:
                w = ws[n][i % len(ws[n])]
                if kind == "cublas":
                    torch.mm(xs[n], w.t(), out=outs[n])
                else:
                    launch.gemv(xs[n], w, out=outs[n], cfg=cfgs[n], pdl=kind == "gemv_pdl")
        nbytes = sum((SHAPES[n][0] + M) * SHAPES[n][1] * 2 + M * SHAPES[n][0] * 2 for n in CHAIN)
        row = dict(M=M, chain=list(CHAIN), cfgs={n: list(c) for n, c in cfgs.items()}, bytes=nbytes,
                   floor_us=nbytes / bw * 1e6, us={}, err={})
        for kind in ("cublas", "gemv", "gemv_pdl", "cublas"):   # cuBLAS first and last: drift shows
            try:
                step["i"] = 0
                run(kind)
                torch.cuda.synchronize()
                err = max(((outs[n].float() - refs[n]).abs().max() / refs[n].abs().max()).item() for n in CHAIN)
                row["err"][kind] = err
                t = time_graph(lambda kind=kind: run(kind), reps=12, iters=30)
                row["us"].setdefault(kind, []).append(t)
            except Exception as e:  # noqa: BLE001 - e.g. no launch_pdl in this Triton: recorded, go on
                row["err"][kind] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        us = {k: min(v) for k, v in row["us"].items()}
        print(f"chain M={M}: " + "  ".join(f"{k} {v:.1f} us" for k, v in us.items())
              + f"  floor {row['floor_us']:.1f} us  err {row['err']}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,8")
    ap.add_argument("--chain", default=None, help="a gemv_bench sweep result: time the GEMM chain (docstring)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from k3compile.kernels import launch
    t0 = time.time()
    bw = hbm_bandwidth()
    if a.chain:
        rows = chain(a, [int(m) for m in a.ms.split(",")], bw)
        save(a.out, dict(rows=rows, hbm_bytes_per_s=bw, bw_seen=BW_SEEN, gpu=torch.cuda.get_device_name(),
                         torch=torch.__version__, triton=__import__("triton").__version__), t0)
        return
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
