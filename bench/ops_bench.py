"""Per-op benchmark: each fused k3 op vs its unfused sequence, TP ranks over NCCL, all CUDA-graphed.

For every op, shape set and M it times, in the same run and on the same random inputs:
  eager    - the unfused PyTorch sequence (cuBLAS GEMM, NCCL all-reduce/all-gather, separate
             elementwise and norm kernels), captured in a CUDA graph;
  inductor - the same sequence through torch.compile(backend="inductor") (functional
             collectives), captured in a CUDA graph;
  k3       - the torch.ops.k3 op (its CUDA kernels), captured in a CUDA graph.
Each graph holds R calls; the time per call is the median over replays / R, measured with CUDA
events. Shape sets: per-rank shapes of TP=2 and of TP=8 (the production case) on however many
ranks run. Also records the max relative error of inductor and k3 against eager, the bytes each
op must read and the floor (bytes / measured HBM bandwidth).

    torchrun-free: python bench/ops_bench.py [--world 2] [--ms 1,4,16,64,256] [--out results.json]
"""
from __future__ import annotations

import argparse
import itertools
import os

from k3compile.config import knob  # noqa: E402
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import BW_SEEN, env, hbm_bandwidth, save, time_graph, with_attrs  # noqa: E402

H, L, E, TOPK = 7168, 3584, 896, 16
SHAPES = {"tp2": dict(heads_dim=12288 // 2, up=H // 2), "tp8": dict(heads_dim=12288 // 8, up=H // 8)}


def run(rank, world, ms, shapes, cold=1, nblocks=0, only="", cute_variants=False, comm_variants=False):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    import k3compile.ops  # noqa: F401
    from k3compile.model.functional import attnres_mix, rms_norm
    from k3compile.runtime import symm

    torch._dynamo.config.cache_size_limit = 64
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)  # the same activations on every rank, as in the model
    group = dist.group.WORLD.group_name
    bf = torch.bfloat16
    eps = 1e-5
    bw = hbm_bandwidth()
    rows = []

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(bf)

    def rot(t):
        """Each call returns the next of `cold` copies of weight t (the same values): with cold > 1
        the weights a graph reads exceed the L2, as a model's layers do; cold == 1 reuses t."""
        return itertools.cycle([t] + [t.clone() for _ in range(cold - 1)]).__next__

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()

    def ar_eager(t):
        dist.all_reduce(t)
        return t

    def ar_func(t):
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))

    from k3compile.kernels import comm, tuning

    def forced(op, fn, oneshot: bool):
        def run():
            keep = tuning.ONESHOT_M[op]
            tuning.ONESHOT_M[op] = (0, 1 << 30) if oneshot else (0, -1)
            try:
                return fn()
            finally:
                tuning.ONESHOT_M[op] = keep
        return run

    def with_knobs(fn, **values):
        return with_attrs(comm, fn, values)

    def with_env(fn, **values):
        """fn() with these environment variables set (read by dispatch at call / capture time)."""
        def run():
            with env(values):
                return fn()
        return run

    kop = {"oproj_ar_norm": "oproj_allreduce_residual", "latent_tail": "moe_latent_tail",
           "router_latent": "router_latent_sharded", "all_reduce": "all_reduce_prefetch"}

    def bench(op, shape, M, nbytes, variants, check, parts=None):
        if only and op not in only.split(","):
            return
        res = {}
        outs = {}
        k3 = variants.pop("k3")
        parts = dict(parts or {})
        prefetch = parts.pop("prefetch", None)
        variants["k3_oneshot"] = forced(kop[op], k3, True)
        variants["k3_nccl_path"] = forced(kop[op], k3, False)
        if op == "oproj_ar_norm" and cute_variants:
            # the CuTe skinny GEMM before the pull all-reduce kernel, and the CuTe GEMM with the
            # push epilogue (every rank's partial stored into every buffer, flags instead of a barrier)
            variants["k3_cute_gemm"] = with_env(forced(kop[op], k3, True), K3_KNOBS="cute=1,cute_push=0")
            variants["k3_cute_push"] = with_env(forced(kop[op], k3, True), K3_KNOBS="cute_push=1")
        if comm_variants and op in ("oproj_ar_norm", "latent_tail"):
            # the communication kernel's ordering options (comm.COMM_*), each against the default
            one = forced(kop[op], k3, True)
            variants["k3_late"] = with_knobs(one, COMM_EARLY=False)
            variants["k3_loop"] = with_knobs(one, COMM_VEC=False)
            variants["k3_before"] = with_knobs(one, COMM_EARLY=False, COMM_VEC=False)   # the kernels before COMM_EARLY / COMM_VEC
            if op == "latent_tail":   # w_up pulled into L2 on the side stream during the all-reduce
                variants["k3_prefetch_up"] = forced(kop[op], prefetch, True)
        part_us = {}
        for name, fn in parts.items():   # the op's GEMM alone (cold weights), for the split
            dist.barrier()
            fn()
            part_us[name] = time_graph(fn)
        for name, fn in variants.items():
            dist.barrier()
            outs[name] = fn()
            res[name] = time_graph(fn)
        errs = {n: check(outs[n], outs["eager"]) for n in outs if n != "eager"}
        from k3compile.kernels.cute import artifacts
        why_not = {k: v for k, v in artifacts.fallbacks().items() if k.startswith("oproj")}
        row = dict(op=op, shapes=shape, M=M, world=world, cold=cold, blocks=nblocks,
                   ar_warps=knob("ar_warps") or None, us=res, err_vs_eager=errs, bytes=nbytes,
                   floor_us=nbytes / bw * 1e6, cute_fallbacks=why_not, parts_us=part_us)
        base = min(res["eager"], res["inductor"])
        lo, hi = tuning.ONESHOT_M[kop[op]]
        row["table_pick"] = "oneshot" if lo <= M <= hi else "nccl_path"
        res["k3"] = res["k3_" + row["table_pick"]]  # what the shipped table (kernels/tuning.py ONESHOT_M) runs
        row["oneshot_wins"] = res["k3_oneshot"] <= res["k3_nccl_path"]
        row["speedup_vs_baseline"] = base / res["k3"]
        rows.append(row)
        if rank == 0:
            print(f"{op:<14} {shape} M={M:<4} " + " ".join(f"{k}={v:7.1f}us" for k, v in res.items())
                  + f"  k3 x{row['speedup_vs_baseline']:.2f} vs best baseline; floor {row['floor_us']:.1f}us; "
                  f"err {errs}", flush=True)

    for shape in shapes:
        K, UP = SHAPES[shape]["heads_dim"], SHAPES[shape]["up"]
        w_o = rnd(H, K, scale=K ** -0.5)
        g_post, w_norm, w_qk = (rnd(H).abs() + 0.5 for _ in range(3))
        w_up = rnd(UP, L, scale=L ** -0.5)
        g_lat = rnd(L).abs() + 0.5
        w_r, w_d = rnd(E, H, scale=H ** -0.5), rnd(L, H, scale=H ** -0.5)
        for M in ms:
            # 1. o-proj + all-reduce + residual + RMSNorm
            x, res_ = rnd(M, K), rnd(M, H)

            wo = rot(w_o)

            blocks = [rnd(M, H) for _ in range(nblocks)]  # AttnRes blocks (a mid-depth layer has 3-7)

            def oproj_eager(w, ar=ar_eager):
                y = ar(F.linear(x, w))
                if blocks:
                    nrm, upd = attnres_mix(res_, y, blocks, w_norm, w_qk, g_post, eps)
                    return upd, nrm
                upd = res_ + y
                return upd, rms_norm(upd, g_post, eps)
            oproj_ind = torch.compile(lambda w: oproj_eager(w, ar_func), backend="inductor")
            bench("oproj_ar_norm", shape, M, H * K * 2 + M * (K + 3 * H) * 2, {
                "eager": lambda: oproj_eager(wo()), "inductor": lambda: oproj_ind(wo()),
                "k3": lambda: torch.ops.k3.oproj_allreduce_residual(x, wo(), res_, blocks, w_norm if blocks else None,
                                                                    w_qk if blocks else None, g_post, eps,
                                                                    group, [])},
                lambda a, b: max(rel(a[0], b[0]), rel(a[1], b[1])), {"gemm": lambda: F.linear(x, wo())})
            # 2. latent tail: finalize + all-reduce + RMSNorm + up shard + add into shared partial
            y = rnd(M, TOPK, L)
            tw = torch.softmax(torch.randn(M, TOPK, device=dev), -1)
            sp = rnd(M, H)

            wu = rot(w_up)

            def tail_eager(w, ar=ar_eager):
                routed = ar((y.float() * tw.unsqueeze(-1)).sum(1).to(bf))
                tail = F.linear(rms_norm(routed, g_lat, eps), w)
                out = sp.clone()
                out[:, rank * UP:(rank + 1) * UP] += tail
                return out
            tail_ind = torch.compile(lambda w: tail_eager(w, ar_func), backend="inductor")
            ln_in = rnd(M, L)

            def tail_prefetch(w):   # the op with its up-projection shard pulled into L2 during the all-reduce
                return torch.ops.k3.moe_latent_tail(y, tw, sp, g_lat, w, eps, rank, group, [w])
            bench("latent_tail", shape, M, UP * L * 2 + M * (TOPK * L + 2 * H) * 2, {
                "eager": lambda: tail_eager(wu()), "inductor": lambda: tail_ind(wu()),
                "k3": lambda: torch.ops.k3.moe_latent_tail(y, tw, sp, g_lat, wu(), eps, rank, group, [])},
                rel, {"gemm": lambda: F.linear(ln_in, wu()), "prefetch": lambda: tail_prefetch(wu())})
            # 3. router + latent projection: replicated GEMMs vs sharded GEMM + all-gather
            xr = rnd(M, H)

            wr, wd = rot(w_r), rot(w_d)

            def router_eager(a, b):
                return F.linear(xr, a), F.linear(xr, b)
            router_ind = torch.compile(router_eager, backend="inductor")
            bench("router_latent", shape, M, (E + L) * H * 2 // world, {
                "eager": lambda: router_eager(wr(), wd()), "inductor": lambda: router_ind(wr(), wd()),
                "k3": lambda: torch.ops.k3.router_latent_sharded(xr, wr(), wd(), rank, world, group)},
                lambda a, b: max(rel(a[0], b[0]), rel(a[1], b[1])))
            # 4. the MoE output all-reduce
            xa = rnd(M, H)
            bench("all_reduce", shape, M, M * H * 2 * world, {
                "eager": lambda: ar_eager(xa.clone()), "inductor": torch.compile(lambda: ar_func(xa), backend="inductor"),
                "k3": lambda: torch.ops.k3.all_reduce_prefetch(xa, group, [])}, rel)
    return dict(rows=rows, hbm_bytes_per_s=bw, bw_seen=BW_SEEN, symm=symm.status(), gpu=torch.cuda.get_device_name(dev),
                torch=torch.__version__)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ms", default="1,4,16,64,256")
    ap.add_argument("--shapes", default="tp2,tp8")
    ap.add_argument("--cold", type=int, default=1,
                    help="cycle through this many copies of each weight, so that they are read from HBM "
                         "and not the 60 MB L2, as in a model (8 is > L2 for every op)")
    ap.add_argument("--blocks", type=int, default=0, help="AttnRes blocks in the o-proj op (0: plain RMSNorm)")
    ap.add_argument("--ops", default="", help="comma list of ops to run (default: all)")
    ap.add_argument("--cute", action="store_true",
                    help="o-proj also as k3_cute_gemm (CuTe skinny GEMM + pull all-reduce) and k3_cute_push "
                         "(CuTe GEMM with the push epilogue); needs the artifacts (K3_CUTE_DIR)")
    ap.add_argument("--comm", action="store_true",
                    help="o-proj and latent tail also with the communication kernels' options: k3_late (peer-"
                         "independent reads after the barrier wait), k3_loop (peers signalled and polled one "
                         "by one), k3_before (both: the kernels before COMM_EARLY and COMM_VEC); the latent tail with w_up "
                         "prefetched into L2 on the side stream")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from k3compile.distributed import run_ranks
    t = time.time()
    res = run_ranks(run, a.world, [int(m) for m in a.ms.split(",")], a.shapes.split(","), a.cold, a.blocks, a.ops,
                    a.cute, a.comm, backend="nccl")
    save(a.out, res[0], t)

if __name__ == "__main__":
    main()
