"""`k3c bench`: decode steps of N real-width Kimi K3 layers on one GPU, eager vs Inductor vs k3.

The layers are built from the real config (`K3Config.kimi_k3`) with the per-rank widths of TP=tp
(heads and intermediate sizes divided by tp; one GPU, no communication), random weights, a random
cache of `ctx` tokens (MLA) and a random KDA state. One decode step runs the layers in a row, as a
model's step does. Each mode (eager: the layers as written; inductor: torch.compile; k3:
torch.compile(backend="k3")) is compiled with static shapes per M, captured in a CUDA graph of
`reps` calls and timed over replays with the host launch hidden behind a GPU spin; each mode is timed
again in `rounds` rounds, in turn, and the median is reported.

The bytes floor is what one step must read at the measured bandwidth: every non-expert weight, the
MXFP4 bytes of the experts the step actually routes to (counted per layer from the eager step's
top-k), the KV cache and the KDA state (read and written). The device's bandwidth is the larger of
a graphed 1 GiB copy and a graphed 2 GiB read-only reduction.
"""
from __future__ import annotations

import dataclasses
import json
import time

KINDS = ("kda", "mla")


class BenchError(RuntimeError):
    """One line for the user: why the bench cannot run as asked."""


def parse_layers(spec: str) -> list[str]:
    """'kda,kda,kda,mla' or '3kda,1mla' -> ['kda', 'kda', 'kda', 'mla']."""
    out = []
    for part in (p.strip().lower() for p in spec.split(",") if p.strip()):
        n, kind = (part[:-3], part[-3:]) if part[-3:] in KINDS else ("", part)
        if kind not in KINDS or (n and not n.isdigit()):
            raise BenchError(f"--layers: {part!r} is not a layer kind (kda or mla, optionally counted: 3kda)")
        out += [kind] * (int(n) if n else 1)
    if not out:
        raise BenchError("--layers: no layer given (e.g. kda,kda,kda,mla)")
    return out


def config(tp: int, ctx: int):
    """The real K3 config with TP=tp per-rank widths (on one GPU)."""
    from ..model import K3Config
    cfg = K3Config.kimi_k3(dtype="bfloat16", max_seq=ctx + 16)
    for name in ("kda_heads", "mla_heads", "expert_inter", "shared_inter", "dense_inter"):
        if getattr(cfg, name) % tp:
            raise BenchError(f"--tp {tp}: {name}={getattr(cfg, name)} does not split over {tp} ranks")
    return dataclasses.replace(cfg, kda_heads=cfg.kda_heads // tp, mla_heads=cfg.mla_heads // tp,
                               expert_inter=cfg.expert_inter // tp, shared_inter=cfg.shared_inter // tp,
                               dense_inter=cfg.dense_inter // tp)


def layer_ids(cfg, kinds: list[str]) -> list[int]:
    """Increasing mid-depth MoE layer ids of those kinds (never the dense layer 0)."""
    ids, last = [], min(cfg.num_layers // 2, cfg.num_layers - 1) - 1
    for kind in kinds:
        pool = cfg.mla_layers if kind == "mla" else cfg.kda_layers
        nxt = [i for i in pool if i > last and not cfg.is_dense(i)]
        if not nxt:
            raise BenchError(f"--layers: the model has no further {kind} layer after layer {last}")
        ids.append(nxt[0])
        last = nxt[0]
    return ids


def materialise(module, device, gen):
    """Random weights for the meta ones: normal / sqrt(fan-in), norms near 1, MXFP4 codes uniform,
    block scales 2^-9..2^-4 (unit-scale activations stay unit-scale)."""
    import torch
    module.to_empty(device=device)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.dtype == torch.uint8:
                lo, hi = (118, 124) if "scale" in name else (0, 256)
                t.copy_(torch.randint(lo, hi, t.shape, generator=gen, device=device, dtype=torch.uint8))
            elif "norm" in name or name.endswith((".g", "_g")) or t.dim() == 1:
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen, device=device))
            else:
                t.copy_(torch.randn(t.shape, generator=gen, device=device) * t.shape[-1] ** -0.5)


class GraphTimer:
    """`reps` calls of fn in one CUDA graph; time() is the median per-call us over `iters` replays,
    the host's launch of each replay hidden behind a GPU spin (as in a model's step graph)."""

    def __init__(self, fn, reps: int = 10):
        import torch
        fn()
        torch.cuda.synchronize()
        self.fn, self.reps, self.graph = fn, reps, torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(reps):
                fn()
        self.graph.replay()
        torch.cuda.synchronize()

    def time(self, iters: int = 20) -> float:
        import torch
        ts = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)
            a.record()
            self.graph.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / self.reps)
        return sorted(ts)[len(ts) // 2]


def bandwidth() -> float:
    """Bytes/s: the larger of a graphed 1 GiB copy (read + write) and a 2 GiB read-only sum."""
    import torch
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy = 2 * x.numel() / (GraphTimer(lambda: y.copy_(x), reps=5).time(10) * 1e-6)
    del x, y
    r = torch.ones(1 << 29, dtype=torch.float32, device="cuda")
    out = torch.empty((), device="cuda")
    read = r.numel() * 4 / (GraphTimer(lambda: torch.sum(r, dim=0, out=out), reps=5).time(10) * 1e-6)
    return max(copy, read)


def count_kernels(fn) -> int:
    """Kernels in one replay of a graph of one call (profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def distinct_experts(step, inputs) -> list[int]:
    """Per MoE layer, the distinct experts the eager step routes to (the expert op's ids)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    seen, op = [], torch.ops.k3model.mxfp4_experts.default

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is op:
                seen.append(int(torch.unique(args[1]).numel()))
            return func(*args, **(kwargs or {}))
    with Spy():
        step(*inputs)
    return seen


def floor_bytes(layers, cfg, M: int, ctx: int, distinct: list[int]) -> int:
    total, moe = 0, iter(distinct)
    for layer in layers:
        d = next(moe) if not layer.is_dense else 0
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            nbytes = t.numel() * t.element_size()
            if name.split(".")[-1] in ("w13", "w13_scale", "w2", "w2_scale"):
                nbytes = nbytes // t.shape[0] * d
            total += nbytes
        if layer.is_mla:
            total += M * ctx * (cfg.kv_lora + cfg.qk_rope) * 2
        else:
            total += 2 * M * cfg.kda_heads * cfg.kda_head_dim ** 2 * 4
    return total


def run(kinds: list[str], tp: int, ms: list[int], ctx: int = 1024, rounds: int = 3, reps: int = 10,
        progress=print) -> dict:
    import torch

    import k3compile
    from ..model import K3Cache, K3Model, TPInfo
    from ..ops.fused import model_experts_on_kernels
    if not torch.cuda.is_available():
        raise BenchError("k3c bench needs a CUDA GPU and none is visible (torch.cuda.is_available() is False)")
    if not ms or min(ms) < 1:
        raise BenchError("--ms: batch sizes must be >= 1")
    cfg = config(tp, ctx)
    ids = layer_ids(cfg, kinds)
    dev = torch.device("cuda", torch.cuda.current_device())
    model = K3Model(cfg, TPInfo(), meta=True, layers=ids)
    need = sum(t.numel() * t.element_size() for t in model.layers.parameters())
    free = torch.cuda.mem_get_info(dev)[0]
    if need > 0.8 * free:
        raise BenchError(f"{len(ids)} layer(s) at TP={tp} widths need {need / 2**30:.1f} GiB of weights; "
                         f"the GPU has {free / 2**30:.1f} GiB free: use fewer layers or a larger --tp")
    gen = torch.Generator(device=dev).manual_seed(0)
    materialise(model.layers, dev, gen)
    model_experts_on_kernels()   # the baselines' experts on the project's kernels, as k3's
    layers = [model.layers[str(i)] for i in ids]
    nb = cfg.blocks_before(ids[0])
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    bw = bandwidth()
    rows = []
    for M in ms:
        cache = K3Cache(cfg, M, TPInfo(), device=dev, max_seq=ctx + 8)
        for d in (cache.conv, cache.state, cache.kv):   # only the built layers' caches
            for i in [i for i in d if i not in ids]:
                del d[i]
        cache.seq_lens.fill_(ctx)
        for t in (*cache.conv.values(), *cache.kv.values()):
            t.copy_(torch.randn(t.shape, generator=gen, device=dev))
        for t in cache.state.values():
            t.copy_(0.5 * torch.randn(t.shape, generator=gen, device=dev))
        snapshot = [t.clone() for t in cache.tensors()]
        inputs = [torch.randn(M, cfg.hidden, generator=gen, device=dev).to(torch.bfloat16) for _ in range(2 + nb)]

        def restore():
            for t, v in zip(cache.tensors(), snapshot):
                t.copy_(v)

        def step(prefix, delta, *blocks):
            bl = list(blocks)
            for layer in layers:
                prefix, delta = layer(prefix, delta, bl, cache, M, 1)
            return prefix, delta

        modes = {"eager": step,
                 "inductor": torch.compile(step, backend="inductor", fullgraph=True, dynamic=False),
                 "k3": torch.compile(step, backend="k3", fullgraph=True, dynamic=False)}
        out, timers, kernels, notes, report = {}, {}, {}, [], None
        for name, fn in modes.items():
            progress(f"M={M}: {name}: compile, check, capture")
            k3compile.clear_reports()
            restore()
            out[name] = fn(*inputs)
            if name == "k3":
                rep = k3compile.last_report()
                report = rep.to_dict() if rep is not None else None
                notes = [n for p in (rep.passes if rep else []) for n in p.notes if n.startswith("kernels:")]
            timers[name] = GraphTimer(lambda fn=fn: fn(*inputs), reps=reps)
            kernels[name] = count_kernels(lambda fn=fn: fn(*inputs))
        us_rounds = {name: [] for name in modes}
        for _ in range(rounds):
            for name, t in timers.items():
                us_rounds[name].append(t.time())
        timers.clear()
        torch.cuda.empty_cache()   # the graphs' private pools: the next M's graphs need the room
        us = {name: sorted(v)[len(v) // 2] for name, v in us_rounds.items()}
        restore()
        distinct = distinct_experts(step, inputs)
        restore()
        fl = floor_bytes(layers, cfg, M, ctx, distinct)
        ref = out["eager"][0].float()
        err = {name: ((o[0].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
               for name, o in out.items() if name != "eager"}
        rows.append(dict(M=M, us=us, us_rounds=us_rounds, us_per_layer={k: v / len(layers) for k, v in us.items()},
                         speedup=min(us["eager"], us["inductor"]) / us["k3"], kernels=kernels,
                         floor_us=fl / bw * 1e6, k3_vs_floor=us["k3"] / (fl / bw * 1e6), floor_bytes=fl,
                         distinct_experts=distinct, rel_err_vs_eager=err, kernels_note=notes,
                         sites={p["name"]: [p["matched"], p["expected"]] for p in (report or {}).get("passes", [])}))
    return dict(layers=kinds, layer_ids=ids, tp=tp, ms=ms, ctx=ctx, rounds=rounds, reps=reps, blocks=nb,
                gpu=torch.cuda.get_device_name(dev), torch=torch.__version__, hbm_bytes_per_s=bw,
                date=time.strftime("%Y-%m-%d"), rows=rows)


def write(path: str, result: dict, command: str) -> None:
    with open(path, "w") as f:
        json.dump(dict(result, command=command), f, indent=1)
