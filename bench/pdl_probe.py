"""The layer-input all-reduce / norm kernel followed by a decode GEMV, with and without PDL (one GPU).

The question (issue 5, MLA at M=1 is 1.6x its floor on an H100): at TP=1 the AttnRes norm before the
MLA qkv_a / KDA in_proj GEMV, and the one before the stacked router + latent GEMV, are one-program
kernels of about 5 us that read almost nothing, and the GEMV after each cannot start streaming its
52-90 MB weight until the norm ends. With K3_KNOBS gemv_pdl (gemm.gemv_pdl) the norm (called with
trigger=True, the argument pass pair_pdl sets) lets its dependent launch at its start and the GEMV
(after_trigger=True), launched with Programmatic Dependent Launch, requests the first PF bytes of its
programs' weight rows into L2 before it waits for the norm. How much of the norm's time does that win back?

Each captured step runs on the next of NCOPY weight copies (together more than 2x the L2), so every
GEMV starts cold. Per shape, us per step (median of rounds, graphed, launch hidden):
  norm      the all-reduce / norm kernel alone (TP=1, 3 AttnRes blocks, M=1)
  gemv      the GEMV alone (the config named, cold weights)
  dispatch  norm, then what gemm.gemv_plan picks for this shape on this GPU (the layer's GEMM), no PDL
  base      norm, then GEMV (no PDL: K3_KNOBS=gemv_pdl=off)
  table     K3_KNOBS=gemv_pdl=on: tuning.GEMV_PDL_PF's bytes for this shape (no PDL for a shape not in it)
  pdl0      K3_KNOBS=gemv_pdl=0: the trigger and the PDL GEMV (its first weight tile before the wait)
  pf<KB>    K3_KNOBS=gemv_pdl=<KB * 1024>: and the first KB KiB of each program's rows into L2 before it
Every variant's GEMV output is compared with base's (the same sums in the same order: equal).

    python bench/pdl_probe.py [--pfs 8,16,32,64] [--shapes ...] [--out r.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import GraphTimer, env, median, save  # noqa: E402

# (N, K, the CUDA-core config): the H100 card rows (kernels/tuning.GEMV_TABLE_BY_CARD)
SHAPES = {"qkv_a mla tp8": (3648, 7168, "gemvl 4/1024/4/3"), "in_proj kda tp8": (6284, 7168, "gemvl 8/512/4/3"),
          "router_latent w1": (4480, 7168, "gemvl 2/1024/4/4")}
L2_BYTES = 50 << 20


def main(argv=None):
    import torch
    from k3compile.kernels import comm, gemm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--pfs", default="8,16,32,64", help="KiB per GEMV program prefetched into L2 (pf rows)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=8, help="steps per captured graph")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.time()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    H, NB, eps = 7168, 3, 1e-6
    bf = torch.bfloat16
    local = torch.randn(1, H, device=dev, dtype=bf)
    res = torch.randn(1, H, device=dev, dtype=bf)
    blocks = [torch.randn(1, H, device=dev, dtype=bf) for _ in range(NB)]
    g = torch.rand(H, device=dev, dtype=bf) + 0.5
    w_norm = torch.rand(H, device=dev, dtype=bf) + 0.5
    w_qk = torch.randn(H, device=dev, dtype=bf) * 0.05
    variants = {"base": {"K3_KNOBS": "gemv_pdl=off"}, "table": {"K3_KNOBS": "gemv_pdl=on"}, "pdl0": {"K3_KNOBS": "gemv_pdl=0"}}
    variants.update({f"pf{kb}": {"K3_KNOBS": f"gemv_pdl={int(kb) * 1024}"} for kb in a.pfs.split(",") if kb})
    rows = []
    for name in a.shapes.split(","):
        N, K, cfg_name = SHAPES[name]
        cfg = gemm.parse_cfg(cfg_name)
        ncopy = max(4, -(-2 * L2_BYTES // (N * K * 2)) + 1)
        ws = [torch.randn(N, K, device=dev, dtype=bf) * 0.02 for _ in range(ncopy)]
        outs = {v: [torch.empty(1, N, device=dev, dtype=bf) for _ in range(a.reps)] for v in variants}

        def norm_only():
            comm.ar_residual_norm(local, None, res, g, w_norm, w_qk, blocks, eps)


        def gemv_only():
            x = local
            for r in range(a.reps):
                gemm.gemv(x, ws[r % ncopy], cfg=cfg)

        def chain(v):   # the pair as pass pair_pdl sets it: the norm's trigger, the GEMV's after_trigger
            def run():
                for r in range(a.reps):
                    _, x = comm.ar_residual_norm(local, None, res, g, w_norm, w_qk, blocks, eps, trigger=True)
                    gemm.gemv(x, ws[r % ncopy], out=outs[v][r], cfg=cfg, after_trigger=True)
            return run

        plan = gemm.gemv_plan(local, ws[0])   # what the layer runs for this shape on this GPU

        def dispatch():
            for r in range(a.reps):
                _, x = comm.ar_residual_norm(local, None, res, g, w_norm, w_qk, blocks, eps)
                if plan is None:
                    torch.mm(x, ws[r % ncopy].t())
                else:
                    gemm.gemv(x, ws[r % ncopy], cfg=plan)

        timers = {"norm": GraphTimer(lambda: [norm_only() for _ in range(a.reps)], reps=1),
                  "gemv": GraphTimer(gemv_only, reps=1)}
        with env({"K3_KNOBS": "gemv_pdl=off"}):
            timers["dispatch"] = GraphTimer(dispatch, reps=1)
        for v, e in variants.items():
            with env(e):
                timers[v] = GraphTimer(chain(v), reps=1)   # compiled and captured under the variant's env
        times = {k: [] for k in timers}
        for _ in range(a.rounds):
            for k, t in timers.items():
                times[k].append(t.time(iters=20, hide_launch=True) / a.reps)
        for t in timers.values():
            t.graph.replay()
        torch.cuda.synchronize()
        err = {v: max(float((outs[v][r].float() - outs["base"][r].float()).abs().max()) for r in range(a.reps))
               for v in variants}
        row = dict(shape=name, N=N, K=K, cfg=cfg_name, dispatch=str(plan), ncopy=ncopy, us={k: median(x) for k, x in times.items()},
                   us_rounds=times, max_abs_diff_vs_base=err)
        row["saved_us"] = {v: row["us"]["base"] - row["us"][v] for v in variants}
        rows.append(row)
        print(name, cfg_name, {k: round(x, 2) for k, x in row["us"].items()}, "diff", err, flush=True)
        del ws, timers
        torch.cuda.empty_cache()
    return save(a.out, dict(rows=rows, gpu=torch.cuda.get_device_name(), torch=torch.__version__), t0)


if __name__ == "__main__":
    main()
