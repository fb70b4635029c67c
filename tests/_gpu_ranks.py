"""Rank functions for the GPU kernel tests (importable by spawned processes)."""
from __future__ import annotations

import torch


def _graphed(fn, *args):
    """fn(*args) captured in a CUDA graph, replayed once; returns the replay's output."""
    fn(*args)  # warm-up outside capture (allocates the symmetric workspace)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args)
    g.replay()
    torch.cuda.synchronize()
    return out


def _randn(dev, rank):
    """rnd(*shape, seed, scale, shared): bf16 normal values, the same on every rank (shared) or
    different per rank."""
    def rnd(*shape, seed, scale=1.0, shared=True):
        g = torch.Generator(device=dev).manual_seed(seed * 97 + (0 if shared else 1000 + rank))
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(torch.bfloat16)
    return rnd


def rel(a, b):
    """max |a - b| / max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def kernels_vs_reference(rank, world, Ms=(1, 5, 64, 256)):
    """Every k3 op through its CUDA kernel (eager and CUDA-graphed) vs the op's PyTorch reference
    (NCCL for the communication); returns per case the max |diff| / max |ref| and what ran."""
    import torch.distributed as dist

    import k3compile.ops  # noqa: F401
    from k3compile.kernels import moe, registry
    from k3compile.ops import reference as ref
    from k3compile.runtime import symm

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name if world > 1 else None
    H, Ko, L, TOPK, E = 7168, 12288 // 8, 3584, 16, 896
    out: dict = {}

    rnd = _randn(dev, rank)

    def case(name, fn_k3, fn_ref, args):
        r = fn_ref(*args)
        k = fn_k3(*args)
        kg = _graphed(fn_k3, *args)
        rs, ks, kgs = (r if isinstance(r, tuple) else (r,)), (k if isinstance(k, tuple) else (k,)), \
            (kg if isinstance(kg, tuple) else (kg,))
        out[name] = dict(err=max(rel(a, b) for a, b in zip(ks, rs) if b.numel()),
                         err_graphed=max(rel(a, b) for a, b in zip(kgs, rs) if b.numel()))

    for M in Ms:
        for nb in (0, 3):
            x = rnd(M, Ko, seed=M, shared=False)
            w = rnd(H, Ko, seed=2, scale=Ko ** -0.5)
            res = rnd(M, H, seed=3)
            blocks = [rnd(M, H, seed=10 + i) for i in range(nb)]
            wn, wq, gm = (rnd(H, seed=20 + i).abs() + 0.5 for i in range(3))
            case(f"oproj M={M} blocks={nb}",
                 lambda *a: torch.ops.k3.oproj_allreduce_residual(*a, 1e-5, group, []),
                 lambda *a: ref.oproj_allreduce_residual(*a, 1e-5, group),
                 (x, w, res, blocks, wn, wq, gm))
            d = rnd(M, H, seed=M + 30, shared=False)   # the layer-input op: its delta, each rank's own
            case(f"residual_norm M={M} blocks={nb}",
                 lambda *a: torch.ops.k3.residual_norm(*a, 1e-5, group, []),
                 lambda *a: ref.residual_norm(*a, 1e-5, group),
                 (d, res, blocks, wn if nb else None, wq if nb else None, gm))
        y = rnd(M, TOPK, L, seed=M + 1, shared=False)
        tw = torch.softmax(torch.randn(M, TOPK, device=dev), -1)
        sp = rnd(M, H, seed=5, shared=False)
        gl = rnd(L, seed=6).abs() + 0.5
        wup = rnd(H // world, L, seed=7 + rank, scale=L ** -0.5)
        case(f"tail M={M}",
             lambda *a: torch.ops.k3.moe_latent_tail(*a, 1e-5, rank, group, []),
             lambda *a: ref.moe_latent_tail(*a, 1e-5, rank, group),
             (y, tw, sp, gl, wup))
        lg = rnd(M, E, seed=13, scale=2.0, shared=False)
        rb = torch.randn(E, generator=torch.Generator(device=dev).manual_seed(14), device=dev) * 0.1
        case(f"router_topk M={M}",  # ids compared as numbers too: one different expert is a large error
             lambda *a: torch.ops.k3.router_topk(*a, TOPK, 2.5), lambda *a: ref.router_topk(*a, TOPK, 2.5), (lg, rb))
        for sort in (False, True):  # both selection forms of the kernel, whichever is the default
            case(f"router_topk sort={sort} M={M}",
                 lambda *a, sort=sort: moe.router_topk(*a, TOPK, 2.5, sort=sort),
                 lambda *a: ref.router_topk(*a, TOPK, 2.5), (lg, rb))
        case(f"router_topk int32 M={M}",
             lambda *a: torch.ops.k3.router_topk(*a, TOPK, 2.5, True),
             lambda *a: ref.router_topk(*a, TOPK, 2.5, True), (lg, rb))
        xr = rnd(M, H, seed=8)
        wr, wd = rnd(E, H, seed=9, scale=H ** -0.5), rnd(L, H, seed=11, scale=H ** -0.5)
        case(f"router_latent M={M}",  # at TP=1: both GEMMs in one op (no gather)
             lambda *a: torch.ops.k3.router_latent_sharded(*a, rank, world, group),
             lambda *a: ref.router_latent_sharded(*a, rank, world, group),
             (xr, wr, wd))
        if world > 1:
            xa = rnd(M, H, seed=12, shared=False)
            pre = [w]
            case(f"all_reduce M={M}",
                 lambda *a: torch.ops.k3.all_reduce_prefetch(*a, group, pre),
                 lambda *a: ref.all_reduce(*a, group).clone(), (xa,))
    out["_kernels"] = {f"{k[0]}": v for k, v in registry.registered().items() if k[1] == "cuda"}
    out["_symm"] = symm.status()
    return out


def oproj_push_vs_reference(rank, world, Ms=(1, 5, 16, 64)):
    """The o-proj op with the CuTe push GEMM forced (K3_KNOBS=cute_push=1) vs the op's reference (NCCL),
    eager and graphed, at both per-rank K of the build; then three calls with a plain all-reduce
    between each (alternating buffer halves, rising sequence numbers) captured in one CUDA graph
    and replayed three times, each output checked. Returns errors, which shapes pushed and the
    CuTe fallback reasons."""
    import os

    import torch.distributed as dist

    import k3compile.ops  # noqa: F401
    from k3compile.kernels import comm
    from k3compile.kernels.cute import artifacts
    from k3compile.ops import reference as ref

    os.environ["K3_KNOBS"] = "cute_push=1"
    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    H = 7168
    out: dict = {}

    rnd = _randn(dev, rank)

    def op(x, w, res, blocks, wn, wq, gm):
        return torch.ops.k3.oproj_allreduce_residual(x, w, res, blocks, wn if blocks else None, wq if blocks else None,
                                                     gm, 1e-5, group, [])

    def reference(x, w, res, blocks, wn, wq, gm):
        return ref.oproj_allreduce_residual(x, w, res, blocks, wn if blocks else None, wq if blocks else None,
                                            gm, 1e-5, group)

    for K in (1536, 6144):
        w = rnd(H, K, seed=2, scale=K ** -0.5)
        wn, wq, gm = (rnd(H, seed=20 + i).abs() + 0.5 for i in range(3))
        for M in Ms:
            for nb in (0, 3):
                args = (rnd(M, K, seed=M, shared=False), w, rnd(M, H, seed=3),
                        [rnd(M, H, seed=10 + i) for i in range(nb)], wn, wq, gm)
                r, k, kg = reference(*args), op(*args), _graphed(op, *args)
                out[f"push K={K} M={M} blocks={nb}"] = dict(
                    err=max(rel(a, b) for a, b in zip(k, r)), err_graphed=max(rel(a, b) for a, b in zip(kg, r)))
        # three calls in one graph, a plain all-reduce kernel between them
        M = 4
        xs = [rnd(M, K, seed=50 + i, shared=False) for i in range(3)]
        res = rnd(M, H, seed=4)
        xa = rnd(M, H, seed=60, shared=False)

        def three():
            outs = []
            for x in xs:
                outs.append(op(x, w, res, [], wn, wq, gm))
                torch.ops.k3.all_reduce_prefetch(xa, group, [])
            return outs
        three()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = three()
        errs = []
        for rep in range(3):
            g.replay()
            torch.cuda.synchronize()
            for x, o in zip(xs, outs):
                r = reference(x, w, res, [], wn, wq, gm)
                errs.append(max(rel(a, b) for a, b in zip(o, r)))
        out[f"push K={K} three calls x three replays"] = dict(err=max(errs), err_graphed=max(errs))
    out["_pushed"] = sorted(f"N={k[1]} K={k[2]} M={k[3]}" for k, v in comm._PUSH.items() if v is not None)
    out["_fallbacks"] = {k: v for k, v in artifacts.fallbacks().items() if k.startswith("oproj")}
    return out
