"""L2 prefetch of a decode GEMM's weight while latency-bound kernels run (one GPU, graphed).

The question: at M=1 a layer spends ~15-26 us in small attention kernels that read little (the
MLA decode, norms, the per-head bmm's) before the o-proj GEMM streams its 22 MB weight from HBM.
If that weight is pulled into L2 (`comm.l2_prefetch`: bulk `cp.async.bulk.prefetch.L2`, fire
and forget) while those kernels run, how much faster is the GEMM, and what does the prefetch cost
the kernels beside it?

Each captured step reads the next of NCOPY weight copies (together > 2x the L2), so every GEMM
starts cold unless prefetched. Per weight shape and M, us per step (median of rounds):
  gemm_cold    the GEMM alone, cold weights          gemm_warm   the same weight every step (L2)
  chain        CHAIN small kernels alone (the stand-in for the attention kernels)
  chain_gemm   the chain, then the GEMM (no prefetch)
  pf_main      the prefetch launched on the main stream before the chain, then chain, GEMM
  pf_side      the prefetch on a side stream forked before the chain, joined before the GEMM
  pf_late      the prefetch on the main stream after the chain, just before the GEMM (no cover)
GEMM: the k3 decode GEMM (kernels/gemm.gemm: the tuned MMA config, else cuBLAS).

    python bench/l2_bench.py [--ms 1,4,16] [--chain 16] [--out r.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import median, save, time_graph  # noqa: E402

SHAPES = {"oproj tp8": (7168, 1536), "q_b mla tp8": (2304, 1536), "qkv_a mla tp8": (3648, 7168), "router_latent w1": (4480, 7168),
          "latent_up w1": (7168, 3584)}
L2_BYTES = 50 << 20


def main(argv=None):
    import torch
    from k3compile.kernels import comm, gemm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--chain", type=int, default=16, help="small kernels between the prefetch and the GEMM")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.time()
    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    small = torch.randn(16, 4096, device=dev)
    rows = []
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        nbytes = N * K * 2
        ncopy = max(4, -(-4 * L2_BYTES // nbytes))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(ncopy)]
        for m in (int(v) for v in a.ms.split(",")):
            x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
            ref = (x.float() @ ws[0].float().t())
            got = gemm.gemm("l2bench", x, ws[0]).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()

            def chain():
                y = small
                for _ in range(a.chain):
                    y = y * 1.0001
                return y

            def step(i, mode):
                w = ws[i % ncopy] if mode != "gemm_warm" else ws[0]
                if mode in ("gemm_cold", "gemm_warm"):
                    return gemm.gemm("l2bench", x, w)
                if mode == "chain":
                    return chain()
                if mode == "pf_main":
                    comm.l2_prefetch(w)
                if mode == "pf_side":
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        comm.l2_prefetch(w)
                chain()
                if mode == "pf_side":
                    torch.cuda.current_stream().wait_stream(side)
                if mode == "pf_late":
                    comm.l2_prefetch(w)
                return gemm.gemm("l2bench", x, w)

            modes = ["gemm_cold", "gemm_warm", "chain", "chain_gemm", "pf_main", "pf_side", "pf_late"]
            us = {md: [] for md in modes}
            for _ in range(a.rounds):
                for md in modes:
                    t = time_graph(lambda md=md: [step(i, md) for i in range(ncopy)], reps=5, iters=10)
                    us[md].append(t / ncopy)
            med = {md: round(median(v), 2) for md, v in us.items()}
            row = dict(shape=name, N=N, K=K, M=m, mbytes=round(nbytes / 1e6, 1), ncopy=ncopy, chain=a.chain,
                       cfg=str(gemm.gemv_plan(x, ws[0])), err=err, us=med,
                       us_rounds={md: [round(v, 2) for v in vs] for md, vs in us.items()},
                       gemm_after_chain=round(med["chain_gemm"] - med["chain"], 2),
                       gemm_after_chain_pf_main=round(med["pf_main"] - med["chain"], 2),
                       gemm_after_chain_pf_side=round(med["pf_side"] - med["chain"], 2))
            rows.append(row)
            print(f"{name:18s} M={m:<3d} {row['cfg']:22s} " + " ".join(f"{k}={v:7.2f}" for k, v in med.items())
                  + f"  err {err:.1e}", flush=True)
    save(a.out, dict(rows=rows, command="python bench/l2_bench.py " + " ".join(argv or sys.argv[1:]),
                     gpu=torch.cuda.get_device_name()), t0)


if __name__ == "__main__":
    main()
