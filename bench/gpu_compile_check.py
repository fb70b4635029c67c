"""GPU check of the compiler with its CUDA kernels (symmetric-memory one-shot communication,
MXFP4 expert kernels, side stream), against the uncompiled model.

Runs the tiny K3 model (bf16) on CUDA: eager vs torch.compile(backend="k3") with
mode="reduce-overhead" (Inductor + CUDA graphs), TP=1 on one GPU and TP=2 over NCCL when two
GPUs are present; prints the match report and the max relative error; writes JSON to $OUT.

    python bench/gpu_compile_check.py
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(rank, world):
    import torch
    os.environ["K3_GATE"] = "off"  # this check is about the passes and kernels on the GPU, not the default gate

    import k3compile
    from k3compile.model import K3Config, K3Model, TPInfo
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    cfg = K3Config.tiny(dtype="bfloat16")
    model = K3Model(cfg, TPInfo.current(), device=dev)
    variants = {
        "inductor": lambda: torch.compile(model, backend="inductor", mode="reduce-overhead", fullgraph=True),
        "k3_eager_mode": lambda: torch.compile(model, backend=k3compile.backend(mode="eager"), fullgraph=True),
        "k3": lambda: torch.compile(model, backend="k3", mode="reduce-overhead", fullgraph=True),
    }
    from torch._dynamo.utils import counters
    res, skips = {}, {}
    for name, mk in variants.items():
        torch._dynamo.reset()
        counters.clear()
        f = mk()
        res[name] = {}
        for M in (1, 4, 8):
            ce, cc = model.new_cache(M), model.new_cache(M)
            worst, first = 0.0, None
            for step in range(4):
                ids = torch.randint(0, cfg.vocab, (M, 1), device=dev, generator=torch.Generator(dev).manual_seed(step))
                ref = model(ids, ce)
                out = f(ids, cc)
                e = ((out - ref).abs().max() / ref.abs().max()).item()
                first = e if first is None else first
                worst = max(worst, e)
            torch.cuda.synchronize()
            res[name][M] = dict(first_step=first, worst=worst)
        skips[name] = counters["inductor"]["cudagraph_skips"]
    rep = k3compile.last_report()
    return dict(err=res, cudagraph_skips=skips, report=rep.render(), passes={p.name: [p.matched, p.expected, p.skipped] for p in rep.passes},
                compiles=len(k3compile.reports()), torch=torch.__version__, gpu=torch.cuda.get_device_name())


if __name__ == "__main__":
    import torch

    from k3compile.distributed import run_ranks
    out = {}
    for world in [int(w) for w in os.environ.get("K3_CHECK_TP", "1,2").split(",")]:
        if torch.cuda.device_count() < world:
            continue
        t = time.time()
        r = run_ranks(run, world)
        out[f"tp{world}"] = dict(ranks=r, seconds=time.time() - t)
        print(f"TP={world}: {r[0]['report']}\nmax rel err per M: {r[0]['err']}  compiles: {r[0]['compiles']} "
              f"cudagraph skips: {r[0]['cudagraph_skips']}", flush=True)
    d = os.environ.get("OUT", ".")
    with open(os.path.join(d, "gpu_compile_check.json"), "w") as fh:
        json.dump(out, fh, indent=1)
