"""Decode GEMV: the Triton GEMVs (kernels/triton_gemv.py: the CUDA-core `gemv_kernel` and the
tensor-core split-K `mma_gemm_kernel`) over a config sweep vs cuBLAS (torch.mm),
one GPU, cold weights (each captured call reads the next of enough weight copies to exceed the
L2), CUDA-graphed, per weight shape and M. The MMA configs are tiles (MMA_TILES) crossed with
splits along K, kept where the grid has between MMA_MIN_PROGRAMS and MMA_MAX_PROGRAMS programs
(`mma_configs`); the CUDA-core GEMV runs only its two best configs of an earlier full sweep
(`--all-gemv`: all of CONFIGS). cuBLAS is timed first and last (drift shows).

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
    "tp8 in_proj_mla": (3648, 7168), "tp8 q_b_mla": (2304, 1536), "tp2 oproj": (7168, 6144),
    "tp2 shared_gate_up": (6144, 7168), "tp2 shared_down": (7168, 3072), "tp2 in_proj_kda": (24752, 7168),
    "tp2 in_proj_mla": (8256, 7168), "tp2 q_b_mla": (9216, 1536),
    # TP=1 with TP=8 per-rank head widths (layer_bench --world 1 --shapes tp8): the router, latent
    # down- and up-projections are whole there (nothing shards them at TP=1)
    "w1 router": (896, 7168), "w1 latent": (3584, 7168), "w1 latent_up": (7168, 3584),
    # the two stacked (shard_router_latent at TP=1: one launch of gemm.mma_gemm2 over both weights;
    # swept here as one [4480, 7168] weight, the same bytes and grid)
    "w1 router_latent": (4480, 7168),
}
CONFIGS = [(2, 1024, 4, 4), (4, 512, 4, 4), (4, 1024, 4, 3), (8, 256, 4, 4), (8, 512, 4, 3), (8, 512, 8, 4),
           (16, 256, 4, 4), (16, 256, 8, 3), (16, 512, 8, 3), (32, 128, 4, 4), (32, 256, 8, 3)]
GEMV_BEST = [(2, 1024, 4, 4), (4, 1024, 4, 3)]   # the only winners of an earlier full sweep
# MMA GEMM tiles (BN, BK, stages, swap), 4 warps, crossed with splits along K
MMA_TILES = [(16, 256, 4, False), (32, 256, 4, False), (32, 128, 6, False), (64, 128, 4, False),
             (64, 256, 3, False), (64, 128, 4, True), (64, 256, 3, True), (128, 128, 3, True)]
MMA_SPLITS = (1, 2, 4, 8)
MMA_MIN_PROGRAMS, MMA_MAX_PROGRAMS = 100, 2200


def cfg_name(cfg) -> str:
    """A dispatch plan's config name: an MmaCfg's, a CUDA-core GEMV tuple's, or "cublas" (None)."""
    from k3compile.kernels import gemm
    return cfg.name() if hasattr(cfg, "name") else (gemm.gemv_name(cfg) if cfg else "cublas")


def mma_configs(N: int, K: int):
    """The MMA GEMM configs swept for a weight [N, K]: every tile and split whose grid has
    MMA_MIN_PROGRAMS..MMA_MAX_PROGRAMS programs and whose splits get at least one BK step each."""
    from k3compile.kernels.gemm import MmaCfg
    out = []
    for bn, bk, st, sw in MMA_TILES:
        for sp in MMA_SPLITS:
            progs = -(-N // bn) * sp
            if MMA_MIN_PROGRAMS <= progs <= MMA_MAX_PROGRAMS and K // sp >= bk:
                out.append(MmaCfg(bn, bk, sp, 4, st, sw))
    return out


# a KDA decode step's GEMMs in order, TP=8 shapes (the attention input projection, o-proj, the
# sharded router + latent rows, the shared expert, the latent up-projection)
CHAIN = ("tp8 in_proj_kda", "tp8 oproj", "tp8 router_shard", "tp8 shared_gate_up", "tp8 shared_down", "tp8 latent_up")


def chain_cfg(sweep: dict, shape: str, M: int, K: int) -> tuple[int, int, int, int]:
    """The sweep's best GEMV config for (shape, M) (the nearest M above if not swept), with BLOCK_K
    capped at K (the PDL GEMV reads one full tile before it waits)."""
    ms = sorted(m for (s, m) in sweep if s == shape)
    m = next((x for x in ms if x >= M), ms[-1])
    bn, bk, nw, ns = sweep[(shape, m)][:4]
    while bk > K:
        bk //= 2
    return bn, bk, nw, ns


def chain(a, ms, bw):
    import json

    import torch

    from k3compile.kernels import gemm
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
                    gemm.gemv(xs[n], w, out=outs[n], cfg=cfgs[n], pdl=kind == "gemv_pdl")
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


def _compile_one(job):
    """In a worker process: launch one MMA config once at the shape (N, K) so that Triton's disk
    cache holds its kernel (same specialisation as the timed launches: M is not specialised)."""
    import torch

    from k3compile.kernels import gemm
    N, K, cfg = job
    x = torch.randn(1, K, device="cuda").bfloat16()
    w = torch.randn(N, K, device="cuda").bfloat16()
    gemm.gemv(x, w, cfg=cfg)
    gemm.gemv(x, w, out=torch.empty(1, N, device="cuda", dtype=torch.bfloat16), cfg=cfg)
    torch.cuda.synchronize()
    return cfg.name()


def precompile(names, workers: int) -> float:
    """Compile every swept MMA config in `workers` processes first (Triton compiles one kernel at a
    time per process; a serial sweep spent most of its time compiling). Returns seconds."""
    import concurrent.futures as cf
    import multiprocessing as mp
    t = time.time()
    jobs = [(*SHAPES[n], c) for n in names for c in mma_configs(*SHAPES[n])]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for f in cf.as_completed([ex.submit(_compile_one, j) for j in jobs]):
            f.result()
    return time.time() - t


def cold_weights(N: int, K: int, g):
    """(w, next): a random bf16 weight [N, K] and a function cycling over it and enough copies
    (>= 200 MB) that each captured call reads its weight from HBM, not from the L2."""
    import torch
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    ncopy = max(2, -(-(200 << 20) // (N * K * 2)))
    return w, itertools.cycle([w] + [w.clone() for _ in range(ncopy - 1)]).__next__


def dispatch_check(a, bw):
    """--dispatch: what gemm.gemm runs (kernels/tuning.GEMV_TABLE: the tuned config, or cuBLAS)
    against torch.mm, per swept shape and M, each timed `--repeats` times in alternating order
    (cold weights, graphed): an independent check of the table's entries, which came from one
    sweep's best of many configs."""
    import torch

    from k3compile.kernels import gemm
    rows = []
    for row, x, w, nxt, ref in cases(a, bw, seed=1):
        name, M = row["shape"], row["M"]
        cfg = gemm.gemv_plan(x, w)
        err = ((gemm.gemm("bench", x, w).float() - ref).abs().max() / ref.abs().max()).item()
        row.update(dispatch=cfg_name(cfg),
                   err=err, us={"cublas": [], "k3": []})
        fns = {"cublas": lambda: torch.mm(x, nxt().t()), "k3": lambda: gemm.gemm("bench", x, nxt())}
        for _ in range(a.repeats):
            for k in ("cublas", "k3"):
                row["us"][k].append(time_graph(fns[k]))
        med = {k: sorted(v)[len(v) // 2] for k, v in row["us"].items()}
        row["speedup_vs_cublas"] = med["cublas"] / med["k3"]
        rows.append(row)
        print(f"{name:20s} M={M:2d} {row['dispatch']:20s} cublas {med['cublas']:6.2f}  k3 {med['k3']:6.2f} us "
              f"(x{row['speedup_vs_cublas']:.2f}; floor {row['floor_us']:.2f}; err {err:.1e})", flush=True)
    return rows


def cases(a, bw, seed: int):
    """Per swept shape (--shapes) and M (--ms): (row: shape, N, K, M, bytes, floor_us; x [M, K]
    random bf16; the shape's cold weight w and its copies' cycle nxt; the fp32 reference x @ w^T).
    A shape's weights are freed after its last M."""
    import torch
    g = torch.Generator("cuda").manual_seed(seed)
    for name in [n for n in a.shapes.split(",") if n] or list(SHAPES):
        N, K = SHAPES[name]
        w, nxt = cold_weights(N, K, g)
        for M in [int(m) for m in a.ms.split(",")]:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            nbytes = (N * K + M * K + M * N) * 2
            yield (dict(shape=name, N=N, K=K, M=M, bytes=nbytes, floor_us=nbytes / bw * 1e6), x, w, nxt,
                   x.float() @ w.float().t())
        del w, nxt
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dispatch", action="store_true", help="time gemm.gemm's pick against cuBLAS (dispatch_check)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--precompile", type=int, default=0, help="compile the MMA configs in this many processes first")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--shapes", default="", help="comma-separated SHAPES names (default: all)")
    ap.add_argument("--all-gemv", action="store_true", help="every CUDA-core GEMV config, not only GEMV_BEST")
    ap.add_argument("--lazy", action="store_true", help="each CUDA-core GEMV config in its LAZY form too (gemvl)")
    ap.add_argument("--no-mma", action="store_true", help="no tensor-core MMA configs")
    ap.add_argument("--dispatch-column", action="store_true",
                    help="a column k3: what gemm.gemm dispatches for the shape and M (not a candidate for best)")
    ap.add_argument("--chain", default=None, help="a gemv_bench sweep result: time the GEMM chain (docstring)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from k3compile.kernels import gemm
    t0 = time.time()
    bw = hbm_bandwidth()
    if a.dispatch:
        rows = dispatch_check(a, bw)
        save(a.out, dict(rows=rows, hbm_bytes_per_s=bw, bw_seen=BW_SEEN, gpu=torch.cuda.get_device_name(),
                         torch=torch.__version__), t0)
        return
    if a.chain:
        rows = chain(a, [int(m) for m in a.ms.split(",")], bw)
        save(a.out, dict(rows=rows, hbm_bytes_per_s=bw, bw_seen=BW_SEEN, gpu=torch.cuda.get_device_name(),
                         torch=torch.__version__, triton=__import__("triton").__version__), t0)
        return
    names = [n for n in a.shapes.split(",") if n] or list(SHAPES)
    if a.precompile:
        print(f"precompiled {sum(len(mma_configs(*SHAPES[n])) for n in names)} MMA configs in "
              f"{precompile(names, a.precompile):.0f} s", flush=True)
    rows = []
    for row, x, w, nxt, ref in cases(a, bw, seed=0):
        name, N, K, M, nbytes = row["shape"], row["N"], row["K"], row["M"], row["bytes"]
        row.update(us={}, err={})
        variants = {"cublas": lambda: torch.mm(x, nxt().t())}
        if a.dispatch_column:   # what gemm.gemm runs for this shape and M (the table / card rows)
            variants["k3"] = (lambda o=None: gemm.gemm("bench", x, nxt()) if o is None else
                              o.copy_(gemm.gemm("bench", x, w)))
        if M <= gemm.GEMV_MAX_M:
            for c in (CONFIGS if a.all_gemv else GEMV_BEST):
                for cc in ((c, c + (1,)) if a.lazy else (c,)):
                    variants[gemm.gemv_name(cc)] = (lambda c=cc, o=None: gemm.gemv(x, nxt(), out=o, cfg=c))
        if M <= gemm.MMA_MAX_M and not a.no_mma:
            for c in mma_configs(N, K):
                variants[c.name()] = (lambda c=c, o=None: gemm.gemv(x, nxt(), out=o, cfg=c))
        variants["cublas last"] = variants["cublas"]
        for vn, fn in variants.items():
            try:   # into a NaN-poisoned output: an element the kernel never writes fails the check
                out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                out = torch.mm(x, w.t(), out=out) if vn.startswith("cublas") else fn(o=out)
                torch.cuda.synchronize()
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                row["err"][vn] = f"{type(e).__name__}: {str(e)[:120]}"
                continue
            row["err"][vn] = err
            if err < 1e-2:   # (NaN fails this too)
                row["us"][vn] = time_graph(fn)
        row["us"]["cublas"] = min(row["us"].pop("cublas last"), row["us"]["cublas"])
        if "k3" in row["us"]:
            row["dispatch"] = cfg_name(gemm.gemv_plan(x, w))
        gem = {k: v for k, v in row["us"].items() if k.startswith("gemv")}
        mma = {k: v for k, v in row["us"].items() if k.startswith("mma")}
        for kind, d in (("gemv", gem), ("mma", mma)):
            if d:
                row[f"best_{kind}"] = min(d, key=d.get)
        ours = {**gem, **mma}
        best = min(ours, key=ours.get)
        row["best"], row["speedup_vs_cublas"] = best, row["us"]["cublas"] / ours[best]
        rows.append(row)
        print(f"{name:20s} M={M:2d} cublas {row['us']['cublas']:6.2f} us  best {best:20s} {ours[best]:6.2f} us "
              f"(x{row['speedup_vs_cublas']:.2f}, {nbytes / ours[best] / 1e6:.2f} TB/s; floor "
              f"{row['floor_us']:.2f})" + (f"  best gemv {gem[row['best_gemv']]:6.2f}" if gem else "")
              + (f"  k3 ({row['dispatch']}) {row['us']['k3']:6.2f}" if "k3" in row["us"] else ""), flush=True)
    save(a.out, dict(rows=rows, hbm_bytes_per_s=bw, bw_seen=BW_SEEN, gpu=torch.cuda.get_device_name(),
                     torch=torch.__version__), t0)


if __name__ == "__main__":
    main()
