"""Per-layer benchmark: one KDA and one MLA decoder layer (with LatentMoE) at real K3 widths.

Each rank builds only the chosen layer (meta device, then random weights on its GPU: the
full-size seeded init would need 80 GB of host memory per expert tensor), with `nb` AttnRes
blocks as a mid-depth layer has, an MLA context of `--ctx` cached tokens (random cache, KDA state and
conv state unless `--cache zero`: a zero KDA state would leave the decay untested), and times one decode
step of that layer, CUDA-graphed, for:
  eager     - the layer as written (cuBLAS, NCCL, the model's expert op running our Triton MXFP4
              kernel, the model's KDA decode op: fla-core's kernel where importable, else PyTorch;
              the result's `kda_decode` says which; the MLA decode op: the Triton kernel of
              kernels/model_ops.py, or with K3_KNOBS=mla_triton=0 its PyTorch reference; `mla_decode` says which)
  inductor  - torch.compile(backend="inductor")
  k3        - torch.compile(backend="k3"), default options: the passes the profitability gate
              (passes/pipeline.py) applies at this M
  k3all     - every pass in its batch range, with the L2 prefetch (gate="off")
  k3-<pass> / k3+<pass> - ablations: all passes but one / that pass alone (--ablate), with
              k3none (no pass), k3-prefetch (every pass, no L2 prefetch: the base the `without`
              rows compare with), k3-cute (every pass, the experts on Triton v3 rather than the CuTe
              GEMVs), k3-cute_pdl (the CuTe GEMVs without Programmatic Dependent Launch
              between gate-up and down, K3_KNOBS=cute_pdl=0) and k3-gemv (every GEMM on cuBLAS: no tuned
              decode GEMM in the ops or in lower_decode_gemm's op, K3_KNOBS=gemv=0); all of them without
              the L2 prefetch, which the gate applies nowhere (earlier
              runs had it, which mixed its cost into every pass's row);
              --ablate-passes P,Q keeps only those passes' rows (with k3none, k3-prefetch, k3-gemv)
  inductor_pdl / k3_pdl - (--pdl) Inductor and k3 with Inductor's Programmatic Dependent Launch
  k3_push   - (--push) k3 with the o-proj GEMM as the CuTe push-epilogue kernel (K3_KNOBS=cute_push=1:
              partials stored into every rank's buffer, flags instead of a barrier)
  k3_gemv   - (--gemv-table J) k3 with the Triton GEMV in its ops wherever the sweep J (from
              bench/gemv_bench.py) found it faster than cuBLAS, with that sweep's best configs
  NAME      - (--env NAME:K=V,...) k3 with those environment variables (e.g. a kernel's setting)
Every compile is static (dynamic=False): after two sizes Dynamo would otherwise compile a dynamic
graph, which is not what a decode step per batch size runs (the first GPU run hit that).
Timing: each variant's step is captured 10 times in one CUDA graph and timed over 20 replays
(median); every variant's graph is kept and timed again in `--rounds` rounds (default 3, in turn),
and the median of the rounds is reported (`us`; every round in `us_rounds`). `us_hidden_launch`: the
same graphs timed with the replay's host launch hidden behind a GPU spin before the start event;
`span_us` (eager, Inductor, k3 and the --env variants): the profiler's first-kernel-start to
last-kernel-end of one graphed call and of ten per graph (per call). Peak memory leaves out the
graphs kept from earlier variants.
plus kernels per step (profiler, one graph replay; for k3 its timeline: each kernel's start, length
and stream), the bytes-over-bandwidth floor (weights the
step must read: every non-expert weight, the distinct experts' MXFP4 bytes, the KV cache and KDA
state), and peak memory per variant (the symmetric workspace is reported beside it: it does not
come from PyTorch's caching allocator).

Shape sets: `tp2` runs the real config at TP=world; `tp8` divides the sharded widths (heads,
expert / shared / dense intermediate) by 8 / world, so that each of the world ranks holds what a
TP=8 rank holds while communicating over `world` GPUs.

    python bench/layer_bench.py --layer kda --shapes tp8 --ms 1,4,16,64,256 [--ablate 1,16] --out r.json
    python bench/layer_bench.py --smoke     # tiny config on CPU, no graphs: checks the plumbing
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3compile.options import PASS_ORDER as PASSES  # noqa: E402  (an ablation row pair per pass)
# environment of a variant while it compiles, runs and is captured: k3-cute runs the routed experts
# on Triton v3 instead of the CuTe f16x2 GEMVs, k3-cute_pdl those without PDL (the baselines and the
# other variants take the default)
ENV = {"k3-cute": {"K3_KNOBS": "cute=0"}, "k3-cute_pdl": {"K3_KNOBS": "cute_pdl=0"}, "k3_push": {"K3_KNOBS": "cute_push=1"},
       "k3-gemv": {"K3_KNOBS": "gemv=0"}}
# Inductor config of a variant (--pdl): its Triton kernels wait for the previous kernel with
# griddepcontrol and are launched with the programmatic-serialization attribute (Hopper), so a
# kernel's launch and prologue overlap the tail of the one before it
CFG = {"inductor_pdl": {"triton.enable_pdl": True}, "k3_pdl": {"triton.enable_pdl": True}}


def _config(shapes: str, world: int, smoke: bool):
    from k3compile.model import K3Config
    if smoke:
        return K3Config.tiny(dtype="bfloat16", max_seq=64)
    cfg = K3Config.kimi_k3(dtype="bfloat16", max_seq=4096)
    if shapes == "tp8":
        f = 8 // world
        import dataclasses
        cfg = dataclasses.replace(cfg, kda_heads=cfg.kda_heads // f, mla_heads=cfg.mla_heads // f,
                                  expert_inter=cfg.expert_inter // f, shared_inter=cfg.shared_inter // f,
                                  dense_inter=cfg.dense_inter // f)
    return cfg


def _layer_id(cfg, kind: str) -> int:
    """A mid-depth layer of that kind (so AttnRes has blocks), never the dense layer 0."""
    ids = cfg.mla_layers if kind == "mla" else cfg.kda_layers
    mid = [i for i in ids if i >= min(cfg.num_layers // 2, cfg.num_layers - 1) and not cfg.is_dense(i)]
    return (mid or [i for i in ids if not cfg.is_dense(i)])[0]


# random weights for the meta ones: the same as `k3c bench` (k3compile/cli/bench.py)
from k3compile.cli.bench import materialise as _materialise  # noqa: E402


def _floor_bytes(layer, cfg, tp_size: int, M: int, ctx: int, distinct_experts: int) -> int:
    total = 0
    for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
        nbytes = t.numel() * t.element_size()
        if name.split(".")[-1] in ("w13", "w13_scale", "w2", "w2_scale"):
            nbytes = nbytes // t.shape[0] * distinct_experts  # only the experts the batch routes to
        total += nbytes
    if layer.is_mla:
        total += M * ctx * (cfg.kv_lora + cfg.qk_rope) * 2
    else:
        total += 2 * M * (cfg.kda_heads // tp_size) * cfg.kda_head_dim ** 2 * 4  # fp32 state read + written
    return total


def run(rank, world, kind, shapes, ms, ctx, ablate, smoke, pdl=False, attribute=False, gemv_table="", rounds=3,
        push=False, ablate_passes=(), envs=None, cache_fill="random"):
    import torch

    import k3compile
    from k3compile.model import K3Model, TPInfo
    from k3compile.runtime import symm
    from bench.common import BW_SEEN, GraphTimer, hbm_bandwidth, median
    from bench.common import env as common_env

    dev = torch.device("cuda", rank) if not smoke else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch._dynamo.config.cache_size_limit = 256
    cfg = _config(shapes, world, smoke)
    idx = _layer_id(cfg, kind)
    tp = TPInfo.current()
    model = K3Model(cfg, tp, meta=True, layers=[idx])
    gen = torch.Generator(device=dev).manual_seed(0)  # the same weights where replicated
    _materialise(model, dev, gen)
    layer = model.layers[str(idx)]
    nb = cfg.blocks_before(idx)
    bw = hbm_bandwidth() if not smoke else 1e12
    if dev.type == "cuda":
        _best_standalone_experts()
    rows = []
    if pdl and not hasattr(torch._inductor.config.triton, "enable_pdl"):
        pdl = False
        print(f"--pdl: this torch ({torch.__version__}) has no inductor config triton.enable_pdl", flush=True)
    env = dict(ENV, k3_gemv={"K3_KNOBS": f"gemv_table={gemv_table}"}) if gemv_table else dict(ENV)
    env.update(envs or {})

    for M in ms:
        cache = model.new_cache(M, max_seq=ctx + 8)
        cache.seq_lens.fill_(ctx)
        if cache_fill == "random":   # a cache as after many steps: the decay and the attention see real values
            for t in (*cache.conv.values(), *cache.kv.values()):
                t.copy_(torch.randn(t.shape, generator=gen, device=dev))
            for t in cache.state.values():
                t.copy_(0.5 * torch.randn(t.shape, generator=gen, device=dev))
        prefix = torch.randn(M, cfg.hidden, generator=gen, device=dev).to(torch.bfloat16)
        delta = torch.randn(M, cfg.hidden, generator=gen, device=dev).to(torch.bfloat16)
        blocks = [torch.randn(M, cfg.hidden, generator=gen, device=dev).to(torch.bfloat16) for _ in range(nb)]

        snapshot = [t.clone() for t in cache.tensors()]

        def restore():  # every variant's checked call starts from the same cache state
            for t, v in zip(cache.tensors(), snapshot):
                t.copy_(v)

        def step(prefix, delta, *blocks):
            return layer(prefix, delta, list(blocks), cache, M, 1)

        mode = "eager" if smoke else "inductor"

        def k3c(**o):  # static shapes: one graph per M, as decode graphs per batch size are; the ablation
            # rows turn the profitability gate off (the passes are what they measure)
            o.setdefault("gate", "off")
            return torch.compile(step, backend=k3compile.backend(mode=mode, **o), fullgraph=True, dynamic=False)
        variants = {"eager": step,
                    "inductor": torch.compile(step, backend="inductor", fullgraph=True, dynamic=False),
                    "k3": k3c(gate="measured"),  # what backend="k3" gives: the gate's measured table
                    "k3all": k3c()}              # every pass in its batch range, with the L2 prefetch
        if pdl:  # Programmatic Dependent Launch in Inductor's Triton kernels (CFG below), both compilers
            variants["inductor_pdl"] = torch.compile(step, backend="inductor", fullgraph=True, dynamic=False)
            variants["k3_pdl"] = k3c(gate="measured")
        if push:  # k3 with the CuTe push-epilogue o-proj GEMM (ENV below)
            variants["k3_push"] = k3c(gate="measured")
        if gemv_table:  # k3 with the Triton GEMV in its ops where that sweep found it faster (ENV below)
            variants["k3_gemv"] = k3c(gate="measured")
        for name in envs or {}:  # --env NAME:K=V,...: k3 (the gate's default) under those variables
            with common_env(envs[name]):  # the backend's options read theirs when it is made
                variants[name] = k3c(gate="measured")
        if M in ablate:  # every ablation row without the L2 prefetch (gated off everywhere), but k3all
            variants["k3none"] = k3c(passes=[])          # the backend with no K3 pass: Inductor + our canonicalisation
            variants["k3-prefetch"] = k3c(prefetch=False)  # every pass, no L2 prefetch: the ablation's base
            variants["k3-gemv"] = k3c(prefetch=False)      # every pass, every decode GEMM on cuBLAS (ENV below)
            if not ablate_passes:
                variants["k3-cute"] = k3c(prefetch=False)      # the experts on Triton v3 (ENV below)
                variants["k3-cute_pdl"] = k3c(prefetch=False)  # the CuTe experts without PDL (ENV below)
            for p in ablate_passes or PASSES:
                variants[f"k3-{p}"] = k3c(prefetch=False, skip=[p])
                variants[f"k3+{p}"] = k3c(prefetch=False, passes=[p])
        res, peak, kernels, errs, reports, top_kernels, attribution, timeline = {}, {}, {}, {}, {}, {}, {}, {}
        ref, timers, us_rounds, row_errs, span, hidden_rounds = {}, {}, {}, {}, {}, {}
        base0 = torch.cuda.memory_allocated() if dev.type == "cuda" else 0

        def measure(name, fn):
            k3compile.clear_reports()
            held = 0
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated() - base0  # the graphs kept from earlier variants
            restore()
            out = fn(prefix, delta, *blocks)
            if name == "eager":
                ref["out"] = out
            errs[name], row_errs[name] = _err(out, ref["out"]), _row_errs(out, ref["out"], M)
            rep = k3compile.last_report()
            if rep is not None:
                reports[name] = {p.name: [p.matched, p.expected, p.skipped] for p in rep.passes}
            if smoke:
                return
            timers[name] = GraphTimer(lambda: fn(prefix, delta, *blocks), reps=10)
            us_rounds[name] = [timers[name].time(iters=20)]
            hidden_rounds[name] = [timers[name].time(iters=20, hide_launch=True)]
            peak[name] = torch.cuda.max_memory_allocated() - held
            kernels[name], top, line = _count_kernels(lambda: fn(prefix, delta, *blocks))
            if name in ("eager", "inductor", "k3", "k3all"):
                top_kernels[name] = top  # [name, launches, us of device time] per kernel name, one replay
            if name == "k3" or name in (envs or {}):
                timeline[name] = line
            if name in ("eager", "inductor", "k3") or name in (envs or {}):
                span[name] = _span_per_call(lambda: fn(prefix, delta, *blocks))
            if attribute and name in ("inductor", "k3"):
                attribution[name] = _attribute(lambda: fn(prefix, delta, *blocks))

        for name, fn in variants.items():
            # ENV: read by the kernels, CFG: by Inductor, when the variant compiles and is captured
            with common_env(env.get(name, {})), torch._inductor.config.patch(CFG.get(name, {})):
                measure(name, fn)
        # the layer's own sensitivity: eager again on inputs moved by about one bf16 ulp. Where this
        # error is as large as the compiled modes', their difference from eager is within what one
        # rounding of the inputs already does (the router's top-k picking another expert), not a bug
        restore()
        sign = lambda t: torch.where(torch.rand(t.shape, generator=gen, device=dev) < 0.5, -1.0, 1.0)  # noqa: E731
        bumped = [(t.float() * (1 + 2.0 ** -7 * sign(t))).to(t.dtype) for t in (prefix, delta, *blocks)]
        out = step(*bumped)
        errs["eager_ulp"], row_errs["eager_ulp"] = _err(out, ref["out"]), _row_errs(out, ref["out"], M)
        restore()
        for _ in range(rounds - 1):  # every variant's graph timed again, in turn: drift hits them alike
            for name, t in timers.items():
                us_rounds[name].append(t.time(iters=20))
                hidden_rounds[name].append(t.time(iters=20, hide_launch=True))
        res = {name: median(ts) for name, ts in us_rounds.items()}
        timers.clear()
        restore()   # the replays above moved the KDA state: the margins are those of the checked calls' inputs
        distinct, margin = _routing(layer, prefix, delta, blocks, cache, M) if not layer.is_dense else (0, None)
        fl = _floor_bytes(layer, cfg, tp.size, M, ctx, distinct)
        row = dict(layer=kind, layer_id=idx, shapes=shapes, world=world, M=M, blocks=nb, ctx=ctx, cache=cache_fill, us=res,
                   kernels=kernels, top_kernels=top_kernels, peak_bytes=peak, err_vs_eager=errs, reports=reports,
                   floor_bytes=fl, floor_us=fl / bw * 1e6, distinct_experts=distinct, us_rounds=us_rounds)
        if margin is not None:  # the error split by how close eager's router came to another top-k set
            row.update(_err_by_margin(row_errs, margin))
            row["route_margin"] = [round(float(v), 6) for v in margin]  # per row, with the errors below
        row["row_err_vs_eager"] = {n: [round(float(v), 6) for v in e] for n, e in row_errs.items()
                                   if e is not None and n in ("inductor", "k3", "eager_ulp")}
        if attribution:
            row["attribution"] = attribution
        if timeline:
            row["timeline"] = timeline
        if span:
            row["span_us"] = span
        if hidden_rounds:   # the same graphs timed with the replay's launch hidden behind a GPU spin
            hid = {name: median(ts) for name, ts in hidden_rounds.items()}
            row["us_hidden_launch"] = hid
            row["us_hidden_launch_rounds"] = hidden_rounds
            row["speedup_vs_baseline_hidden_launch"] = min(hid["eager"], hid["inductor"]) / hid["k3"]
            row["k3_vs_floor_hidden_launch"] = hid["k3"] / row["floor_us"]
        if res:
            base = min(res["eager"], res["inductor"])
            row["speedup_vs_baseline"] = base / res["k3"]
            row["k3_vs_floor"] = res["k3"] / row["floor_us"]
        rows.append(row)
        if rank == 0:
            print(f"{kind} {shapes} M={M:<4} " + " ".join(f"{k}={v:8.1f}us" for k, v in res.items())
                  + (f"  k3 x{row['speedup_vs_baseline']:.2f} vs best baseline, {row['k3_vs_floor']:.2f}x floor "
                     f"({row['floor_us']:.1f}us); kernels {kernels}" if res else "")
                  + f"  err {errs}  passes {reports.get('k3')}"
                  + (f"  near-tie rows {row['near_tie_rows']}/{M}, err over the others "
                     f"{row['err_vs_eager_clear_rows']}" if "near_tie_rows" in row else ""), flush=True)
    # ablation_base: the row the `without` ablation rows are compared with (report.py)
    from k3compile.model import attention_ops
    kda_decode = ("fla-core fused_recurrent_kda" if dev.type == "cuda" and attention_ops.fla_fused_recurrent_kda()
                  else "PyTorch reference recurrence")  # what every mode's KDA decode op ran
    from k3compile.kernels import model_ops   # every mode's MLA decode op on Triton unless K3_KNOBS=mla_triton=0
    mla_decode = ("Triton (kernels/triton_mla.py)" if dev.type == "cuda" and model_ops._DONE
                  else "PyTorch reference (attention_ops.mla_core)")
    return dict(rows=rows, ablation_base="k3-prefetch", hbm_bytes_per_s=bw, bw_seen=BW_SEEN, symm=symm.status(),
                kda_decode=kda_decode, mla_decode=mla_decode,
                gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__)


def _best_standalone_experts():
    """The baselines run the model's expert op on our MXFP4 expert kernels (the fastest standalone
    ones we have), not on the model's capture-safe PyTorch path, which dequantises every pair's
    expert to fp32 and is 9-10x slower (BENCHMARKS.md): otherwise k3's lead would mostly be that
    kernel. k3 calls the same kernels through k3::mxfp4_experts, so what remains is the passes."""
    from k3compile.ops.fused import model_experts_on_kernels
    model_experts_on_kernels()


# a row whose eager top-k scores (sigmoid + bias) leave less than this between the k-th and the
# (k+1)-th expert may pick another set under any other GEMM order: its error is reported apart
ROUTE_TIE = 1e-2


def _rel(a, b):
    """|a - b| relative to b's largest magnitude, elementwise."""
    return (a.float() - b.float()).abs() / b.float().abs().max().clamp_min(1e-6)


def _err(out, ref) -> float:
    """err_vs_eager: the largest relative difference over the layer's outputs."""
    return max(_rel(a, b).max().item() for a, b in zip(out, ref))


def _row_errs(out, ref, M):
    """The same per token row, over the layer's [M, ...] outputs."""
    import torch
    per = [_rel(a, b).reshape(M, -1).amax(1) for a, b in zip(out, ref) if a.dim() and a.shape[0] == M]
    return torch.stack(per).amax(0).cpu() if per else None


def _err_by_margin(row_errs, margin):
    """err_vs_eager over the rows eager routed without a near tie (margin >= ROUTE_TIE) and over the
    rest: a wrong kernel shows in the first; a top-k flip on a near tie only in the second."""
    near = margin < ROUTE_TIE
    clear = {n: float(e[~near].max()) if (~near).any() else 0.0 for n, e in row_errs.items() if e is not None}
    tied = {n: float(e[near].max()) if near.any() else 0.0 for n, e in row_errs.items() if e is not None}
    return dict(route_tie=ROUTE_TIE, near_tie_rows=int(near.sum()), min_route_margin=float(margin.min()),
                err_vs_eager_clear_rows=clear, err_vs_eager_near_tie_rows=tied)


def _routing(layer, prefix, delta, blocks, cache, M):
    """How many distinct experts this batch routes to (the bytes the expert op must read), and per
    row the gap between the k-th and (k+1)-th largest selection score of eager's router top-k."""
    import torch
    seen, margins = [], []
    op = torch.ops.k3model.mxfp4_experts.default

    def hook(mode_op, args):
        if mode_op is op:
            seen.append(int(torch.unique(args[1]).numel()))
        elif mode_op is torch.ops.aten.topk.default and not margins:  # the router's selection
            k = int(args[1])
            top = args[0].float().topk(min(k + 1, args[0].shape[-1]), dim=-1).values
            margins.append((top[:, k - 1] - top[:, k]).cpu() if top.shape[-1] > k else torch.full((M,), 1.0))

    from torch.utils._python_dispatch import TorchDispatchMode

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            hook(func, args)
            return func(*args, **(kwargs or {}))
    state = [t.clone() for t in cache.tensors()]
    with Spy():
        layer(prefix, delta, list(blocks), cache, M, 1)
    for t, s in zip(cache.tensors(), state):
        t.copy_(s)
    return (seen[0] if seen else 0), (margins[0] if margins else None)


def _attribute(fn, top=40):
    """[op, input shapes, calls, self device us] of one un-graphed step, the largest first: which
    GEMM (by its shapes) or k3 op the device time belongs to (a graph replay names kernels only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us > 0:
            rows.append([e.key[:80], str(e.input_shapes)[:160], e.count, round(us, 2)])
    return sorted(rows, key=lambda r: -r[3])[:top]


def _count_kernels(fn) -> tuple:
    import torch
    from torch.profiler import ProfilerActivity, profile
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for e in evs:
        c = by_name.setdefault(e.name[:90], [0, 0.0])
        c[0] += 1
        c[1] += e.device_time
    # every kernel name (communication kernels include the wait for the peer, so their times are not
    # their own cost); the sum of the others shows how much of a step is kernels vs gaps
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    # the replay's timeline: [kernel, start us from the first kernel's start, us, stream], in start order
    # (which kernels overlap, which wait: the side stream's against the main one's)
    evs = sorted(evs, key=lambda e: e.time_range.start)
    t0 = evs[0].time_range.start if evs else 0
    line = [[e.name[:48], round(e.time_range.start - t0, 2), round(e.device_time, 2),
             getattr(e, "device_resource_id", None)] for e in evs]
    return len(evs), [[n, c, round(t, 2)] for n, (c, t) in rows], line


def _span_per_call(fn, reps: int = 10) -> dict:
    """From the first kernel's start to the last one's end (profiler) of one graphed call ("one"), and
    of `reps` calls in one graph divided by reps ("per_call", what GraphTimer's events time, less the
    replay's launch): where per_call exceeds one, consecutive calls do not follow each other as
    closely as one call's kernels do."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    out = {}
    for key, n in (("one", 1), ("per_call", reps)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        torch.cuda.synchronize()
        g.replay()   # once unprofiled: the profiled replay is not the graph's first
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        if evs:
            t0 = min(e.time_range.start for e in evs)
            t1 = max(e.time_range.start + e.device_time for e in evs)
            out[key] = round((t1 - t0) / n, 2)
    return out


def parse_env(spec: str) -> tuple:
    """--env NAME:K=V[,K=V] -> (NAME, {K: V}); a comma-separated piece without "=", or whose name is not an
    upper-case variable, continues the value before it, and K3_KNOBS given twice joins its values
    (K3_UNGATED=a,b,K3_KNOBS=cute=0,mxfp4=v3: {K3_UNGATED: "a,b", K3_KNOBS: "cute=0,mxfp4=v3"}). (None, None)
    if malformed."""
    name, _, kvs = spec.partition(":")
    env = {}
    last = None
    for piece in kvs.split(","):
        key = piece.split("=", 1)[0]
        if "=" in piece and key.isupper():   # a variable (K3_KNOBS twice: its values joined)
            last, v = piece.split("=", 1)
            env[last] = env[last] + "," + v if last in env else v
        elif "=" in piece and last is not None:   # K3_KNOBS=a=1,b=2: the knob b continues K3_KNOBS
            env[last] += "," + piece
        elif last is not None and piece:
            env[last] += "," + piece
        else:
            return None, None
    return (name, env) if name and env else (None, None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", choices=["kda", "mla"], default="kda")
    ap.add_argument("--shapes", choices=["tp2", "tp8"], default="tp8")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ms", default="1,4,16,64,256")
    ap.add_argument("--ctx", type=int, default=1024, help="MLA: cached tokens attended to")
    ap.add_argument("--ablate", default="", help="the M values that get the per-pass ablation rows, e.g. 1,16")
    ap.add_argument("--ablate-passes", default="",
                    help="only these passes' ablation rows (and k3none, k3-prefetch, k3-gemv), e.g. lower_decode_gemm")
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU, TP=1, no timing")
    ap.add_argument("--attribute", action="store_true",
                    help="per-op device time of one un-graphed Inductor and k3 step (which GEMM is which)")
    ap.add_argument("--gemv-table", default="", help="a bench/gemv_bench.py result: adds the k3_gemv variant")
    ap.add_argument("--pdl", action="store_true", help="also time Inductor and k3 with Inductor's PDL (CFG)")
    ap.add_argument("--push", action="store_true", help="also time k3 with the CuTe push-epilogue o-proj (k3_push)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="times every variant's kept graph this many times, in turn; the median is reported")
    ap.add_argument("--env", action="append", default=[], metavar="NAME:K=V[,K=V]",
                    help="one more k3 variant NAME, compiled, run and captured with these environment variables")
    ap.add_argument("--cache", choices=["random", "zero"], default="random",
                    help="the KV cache, KDA state and conv state the step starts from: random values (as after many "
                         "steps; the default) or zeros")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    envs = {}
    for spec in a.env:
        name, env = parse_env(spec)
        if name is None or name in ENV or name in envs:
            ap.error(f"--env {spec!r}: want NAME:K=V[,K=V] with a new NAME")
        envs[name] = env
    from bench.common import save
    from k3compile.distributed import run_ranks
    t = time.time()
    ms = [int(m) for m in a.ms.split(",")]
    world = 1 if a.smoke else a.world
    ablate = {int(m) for m in a.ablate.split(",") if m}
    res = run_ranks(run, world, a.layer, a.shapes, ms, 16 if a.smoke else a.ctx, ablate, a.smoke, a.pdl, a.attribute,
                    os.path.abspath(a.gemv_table) if a.gemv_table else "", max(1, a.rounds), a.push,
                    tuple(p for p in a.ablate_passes.split(",") if p), envs, a.cache,
                    **({} if a.smoke else {"backend": "nccl"}))
    save(a.out, res[0], t)

if __name__ == "__main__":
    main()
