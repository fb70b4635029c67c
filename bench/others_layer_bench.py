"""One decoder layer of an independently written K3 model (tests/others/fused.py, "others") against one
of the reference model ("ref"), at real K3 widths with TP=8 per-rank shapes on one GPU (layer_bench's
`--shapes tp8 --world 1`: 12 KDA heads of 128, 896 MXFP4 experts top-16 of intermediate 384, latent
3584, shared intermediate 768; a full-width latent up-projection at world 1), eager, Inductor and
torch.compile(step, backend="k3") (default options), in one process: "others' k3 step within 5% of ref's".

ref: layer_bench's builder (meta, random weights on the GPU), its mid-depth KDA MoE layer; vocabulary 256
(read by the `model` cut only). others: FusedK3 without build() (FULL weights on the CPU) by
`build_fused_random`: fused._pack's per-layer dict of clones of ref's random tensors (same layouts; KDA
state transposed to [M, H, dv, dk]): one function (err_vs_eager[others_eager_vs_ref_eager]; a router
near-tie may flip an expert). Cuts (--cuts):
  layer  layer_bench's step: (prefix, delta, blocks) -> pre-attention mixer (residual add, mix over 3
         blocks, none written), KDA, post-attention mixer, LatentMoE; others: FusedK3.step's loop body
         (blocks in its cache buffer). k3 finds ref's layer by its k3model:: ops; others' by role (plain-
         torch cores, a first residual add of two graph inputs): its router, finalize, o-proj (on CPU, k3's
         eager mode and Inductor's passes alike), not its layer-input norm (an AttnRes source read from the
         cache buffer, a graph input) nor the shared-expert overlap.
  model  (ref_model / others_model) a one-layer model's whole step: embedding, the layer (no blocks),
         final mixer, LM head [256, H]: what k3 sees of a whole model, where it finds others' layers by role.
Experts: ref's k3model::mxfp4_experts on moe.mxfp4_experts (layer_bench's _best_standalone_experts;
K3_KNOBS=mxfp4=v3 forces Triton v3); others' fusedk3::mxfp4_grouped_mm (CPU-only as written) on
`grouped_mm_triton`, Triton v3's per-pair MXFP4 GEMV, W13 then W2 with SiTU between (k3 keeps the op).
Timing as layer_bench: 10 steps per CUDA graph, median of 20 replays, `--rounds` rounds in turn, median
(`us`; `us_hidden_launch`: the replay's launch hidden). Others' layer-cut step adds into its input in place.

    python bench/others_layer_bench.py --ms 1,16 --rounds 3 --out bench/results/others_layer_kda_tp8_w1.json
    python bench/others_layer_bench.py --smoke    # tiny widths on CPU, k3 in eager mode, no graphs
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from k3compile.config import knob  # noqa: E402
import sys
import time

if "--smoke" in sys.argv:   # the Triton v3 GEMV check below runs in Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _div(n: int, opts) -> int:
    return next((b for b in opts if n % b == 0), 0)


def grouped_mm_triton(x, expert_ids, w, w_scale):
    """fusedk3::mxfp4_grouped_mm (y[r] = W[ids[r]] @ x[r]; W [E, N, K/2] E2M1, [E, N, K/32] E8M0) as
    Triton v3's down kernel, a per-pair grouped MXFP4 GEMV: long rows (K/2 % 256 == 0: the W13 call)
    with v3's gate-up tiles (64 rows, 256-byte k steps), others with its down tiles (128 rows, 64)."""
    from k3compile.kernels import triton_moe as KM
    (R, K), N = x.shape, w.shape[1]
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    bkb = _div(K // 2, (256, 128, 64))
    bl = _div(N, (64,) if bkb == 256 else (128, 64))
    if not (bkb and bl):
        raise ValueError(f"grouped MXFP4 GEMV: K={K}, N={N} fit no v3 tile")
    if R:
        KM.mxfp4_down_v3_kernel[(R, N // bl)](x.contiguous(), expert_ids.contiguous(), w, w_scale, out, K, N,
                                              BL=bl, BKB=bkb, BT=16, FP16=0, DOT_F32=int(not x.is_cuda),
                                              num_warps=4, num_stages=3)
    return out


def fused_config(c):
    """FusedK3's config at ref's (per-rank) widths: one KDA MoE layer, no dense layer."""
    from tests.others import fused
    return fused.tiny_config(hidden_size=c.hidden, vocab_size=c.vocab, layer_types=("kda",), dense_layers=(),
                             rms_norm_eps=c.rms_eps, kda_num_heads=c.kda_heads, kda_head_dim=c.kda_head_dim,
                             kda_conv_size=c.kda_conv, kda_gate_rank=c.kda_f_rank,
                             kda_gate_lower_bound=c.kda_gate_lower, n_routed_experts=c.num_experts,
                             num_experts_per_tok=c.top_k, moe_intermediate_size=c.expert_inter,
                             moe_latent_size=c.latent, shared_intermediate_size=c.shared_inter,
                             routed_scaling_factor=c.routed_scaling, situ_beta=c.situ_beta,
                             situ_linear_beta=c.situ_linear_beta, attn_res_block_size=c.attnres_block,
                             attn_res_max_blocks=c.attnres_max_blocks)


def build_fused_random(fcfg, model, layer):
    """A world-1 FusedK3 of one layer (fused._pack's dict; `write` False: the layer stores no block),
    embedding, final mixer and LM head, cloned from ref's random tensors: no full-weight generation."""
    from tests.others import fused
    m = fused.FusedK3.__new__(fused.FusedK3)
    m.cfg, m.rank, m.world, m.dtype, m.group, m.eps = fcfg, 0, 1, torch.bfloat16, None, fcfg.rms_norm_eps
    c = lambda t: t.detach().clone()  # noqa: E731
    mix = lambda r: (c(r.w_norm), c(r.w_qk), c(r.g))  # noqa: E731
    a, moe = layer.attn, layer.mlp
    m.embed, m.lm_head, m.final_mix = c(model.embed), c(model.lm_head), mix(model.final_res)
    m.layers = [dict(kind="kda", pre=mix(layer.attn_res), post=mix(layer.mlp_res), dense=False, write=False,
                     in_proj=c(a.in_proj), f_b=c(a.f_b), conv=c(a.conv), A=a.A_log.detach().float().exp(),
                     dt_bias=c(a.dt_bias).float(), o_norm=c(a.o_norm), o_proj=c(a.o_proj),
                     router_down=torch.cat([moe.router.detach(), moe.latent_down.detach()]).contiguous(),
                     bias=c(moe.router_bias).float(), lat_norm=c(moe.latent_norm), lat_up=c(moe.latent_up),
                     w13=c(moe.w13), w13_scale=c(moe.w13_scale), w2=c(moe.w2), w2_scale=c(moe.w2_scale),
                     gate_up=c(moe.shared.gate_up), down=c(moe.shared.down))]
    return m


def fused_cache(m, conv, state, blocks, M):
    """FusedK3Cache of ref's conv / KDA state (copies) and a block buffer holding `blocks` (+ one slot)."""
    from tests.others import fused
    buf = torch.zeros(len(blocks) + 1, M, m.cfg.hidden_size, dtype=m.dtype, device=conv.device)
    for i, b in enumerate(blocks):
        buf[i].copy_(b)
    return fused.FusedK3Cache({0: conv.clone()}, {0: state.transpose(-1, -2).contiguous()}, {},
                              torch.zeros(M, dtype=torch.int64, device=conv.device), buf)


def _summary(rep):
    """The k3 match report: per pass [matched, expected, skipped or error], the first near-misses."""
    if rep is None:
        return None
    return dict(structure=rep.structure, cache_hit=rep.cache_hit,
                passes={p.name: [p.matched, p.expected, p.skipped or p.error] for p in rep.passes},
                near_misses={p.name: [nm.reason[:160] for nm in p.near_misses[:2]] for p in rep.passes
                             if p.near_misses})


def _models(M, cfg, model, idx, layer, nb, oth, gen, dev, cuts):
    """name -> (step, its inputs, the state tensors a checked call starts from)."""
    cache = model.new_cache(M, max_seq=8)
    conv, state = cache.conv[idx], cache.state[idx]
    conv.copy_(torch.randn(conv.shape, generator=gen, device=dev))
    state.copy_(0.5 * torch.randn(state.shape, generator=gen, device=dev))
    rn = lambda: torch.randn(M, cfg.hidden, generator=gen, device=dev).to(torch.bfloat16)  # noqa: E731
    prefix, delta, blocks = rn(), rn(), [rn() for _ in range(nb)]
    ids = torch.randint(0, cfg.vocab, (M,), generator=gen, device=dev)
    fc, fcm = fused_cache(oth, conv, state, blocks, M), fused_cache(oth, conv, state, [], M)
    fprefix, L = prefix.clone(), oth.layers[0]

    def ref_step(prefix, delta, *blocks):
        return layer(prefix, delta, list(blocks), cache, M, 1)

    def oth_step(prefix, delta):   # FusedK3.step's loop body for its layer, from nb blocks
        x, n = oth._mix(prefix, delta, nb, fc.blocks, L["pre"], L["write"])
        a = oth._kda(x, L, 0, fc)
        x, n = oth._mix(prefix, a, n, fc.blocks, L["post"], False)
        return prefix, oth._moe(x, L)
    out = {}
    if "layer" in cuts:
        out["ref"] = (ref_step, (prefix, delta, *blocks), [conv, state])
        out["others"] = (oth_step, (fprefix, delta), [fprefix, fc.conv[0], fc.state[0], fc.blocks])
    if "model" in cuts:
        out["ref_model"] = (lambda ids: model(ids[:, None], cache), (ids,), [conv, state, cache.seq_lens])
        out["others_model"] = (lambda ids: oth.step(ids, fcm), (ids,), [fcm.conv[0], fcm.state[0], fcm.pos])
    return out


def run(ms, rounds, smoke, cuts):
    import k3compile
    from bench.common import GraphTimer, median
    from bench.layer_bench import _best_standalone_experts, _config, _count_kernels, _err, _layer_id, _materialise
    from k3compile.model import K3Model, TPInfo

    dev = torch.device("cpu" if smoke else "cuda")
    torch._dynamo.config.cache_size_limit = 256
    cfg = dataclasses.replace(_config("tp8", 1, smoke), vocab=256)
    idx = _layer_id(cfg, "kda")
    model = K3Model(cfg, TPInfo.current(), meta=True, layers=[idx])
    gen = torch.Generator(device=dev).manual_seed(0)
    _materialise(model, dev, gen)
    layer, nb = model.layers[str(idx)], cfg.blocks_before(idx)
    fcfg = fused_config(cfg)
    oth = build_fused_random(fcfg, model, layer)
    rows, checks = [], {}
    if smoke:   # the kernel given to FusedK3's expert op on the GPU, against the op's own implementation
        from tests.others import fused
        g = torch.Generator().manual_seed(1)
        x, ids = torch.randn(6, 128, generator=g).bfloat16(), torch.randint(0, 3, (6,), generator=g)
        w = torch.randint(0, 256, (3, 64, 64), generator=g).to(torch.uint8)
        s = torch.randint(120, 126, (3, 64, 4), generator=g).to(torch.uint8)
        checks["grouped_mm_triton_err"] = _err((grouped_mm_triton(x, ids, w, s),),
                                               (fused._mxfp4_grouped_mm_impl(x, ids, w, s),))
        print(f"grouped_mm_triton vs fusedk3's own op: rel err {checks['grouped_mm_triton_err']:.2e}")
    else:
        _best_standalone_experts()
        torch.library.register_kernel("fusedk3::mxfp4_grouped_mm", "cuda", grouped_mm_triton)
    backend = k3compile.backend(mode="eager") if smoke else "k3"
    for M in ms:
        models = _models(M, cfg, model, idx, layer, nb, oth, gen, dev, cuts)
        fns, snaps = {}, {}
        for name, (step, args, state) in models.items():
            snaps[name] = [t.clone() for t in state]
            fns[f"{name}_eager"] = step
            for v, be in (("inductor", "inductor"), ("k3", backend)):
                if not (smoke and v == "inductor"):   # CPU Inductor: a C++ build per graph, too slow here
                    fns[f"{name}_{v}"] = torch.compile(step, backend=be, fullgraph=True, dynamic=False)
        outs, errs, reports, kernels, top, timers, us_r, hid_r = {}, {}, {}, {}, {}, {}, {}, {}
        for key, fn in fns.items():
            name = key.rsplit("_", 1)[0]
            args = models[name][1]
            for t, s in zip(models[name][2], snaps[name]):   # every checked call from the same state
                t.copy_(s)
            k3compile.clear_reports()
            t0 = time.time()
            out = fn(*args)
            outs[key] = tuple(o.clone() for o in (out if isinstance(out, tuple) else (out,)))
            print(f"M={M} {key}: first call {time.time() - t0:.1f}s", flush=True)
            errs[key] = _err(outs[key], outs[f"{name}_eager"])
            if key.endswith("_k3"):
                reports[key] = _summary(k3compile.last_report())
            if smoke:
                continue
            call = lambda fn=fn, args=args: fn(*args)  # noqa: E731
            timers[key] = GraphTimer(call, reps=10)
            us_r[key] = [timers[key].time(iters=20)]
            hid_r[key] = [timers[key].time(iters=20, hide_launch=True)]
            kernels[key], top[key], _ = _count_kernels(call)
        for _ in range(rounds - 1):   # every graph again, in turn: drift hits all variants alike
            for key, t in timers.items():
                us_r[key].append(t.time(iters=20))
                hid_r[key].append(t.time(iters=20, hide_launch=True))
        timers.clear()
        us = {k: median(v) for k, v in us_r.items()}
        hid = {k: median(v) for k, v in hid_r.items()}
        row = dict(M=M, layer_id=idx, blocks=nb, us=us, us_hidden_launch=hid, us_rounds=us_r,
                   us_hidden_launch_rounds=hid_r, kernels=kernels, reports=reports, err_vs_eager=errs,
                   top_kernels={k: v[:12] for k, v in top.items() if not k.endswith("_eager")})
        for o, r in (("others", "ref"), ("others_model", "ref_model")):
            if f"{o}_eager" in outs:
                errs[f"{o}_eager_vs_{r}_eager"] = _err(outs[f"{o}_eager"], outs[f"{r}_eager"])
            if f"{o}_k3" in us:
                row[f"{o}_k3_over_{r}_k3"] = us[f"{o}_k3"] / us[f"{r}_k3"]
                row[f"{o}_k3_over_{r}_k3_hidden_launch"] = hid[f"{o}_k3"] / hid[f"{r}_k3"]
                row[f"{o}_within_5pct"] = row[f"{o}_k3_over_{r}_k3"] <= 1.05
        rows.append(row)
        if us:
            print(f"M={M} " + " ".join(f"{k}={v:.1f}us" for k, v in us.items()) + "\n" + " ".join(
                f"{k}={v}" for k, v in row.items() if "_over_" in k or "within" in k) + f" kernels {kernels}")
        print(f"M={M} err {errs}", flush=True)
        for key, rep in reports.items():   # matched/expected per pass; "-": skipped (the JSON says why)
            print(f"M={M} {key}: {rep and rep['structure']}\n  " + (rep and " ".join(
                f"{n}={m}/{e}" + ("-" if s else "") for n, (m, e, s) in rep["passes"].items())), flush=True)
    from k3compile.kernels import moe
    ref_exp = {M: knob("mxfp4") or moe.default_mxfp4_variant(True, cfg.latent, cfg.expert_inter,
                                                                              not smoke, M) for M in ms}
    return dict(rows=rows, checks=checks, cuts=sorted(cuts), shapes="tp8", world=1, ref_config=cfg.to_json(),
                others_config=repr(fcfg), ref_experts="CPU" if smoke else f"moe.mxfp4_experts, variant per M {ref_exp}",
                others_experts="CPU" if smoke else "grouped_mm_triton (Triton v3 per-pair MXFP4 GEMV), W13 then W2",
                gpu=torch.cuda.get_device_name() if not smoke else "cpu", torch=torch.__version__)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cuts", default="layer,model", help="layer (layer_bench's step), model (a one-layer model)")
    ap.add_argument("--smoke", action="store_true", help="tiny widths on CPU, k3 in eager mode, no CUDA graphs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from bench.common import save
    t = time.time()
    ms = [1, 3] if a.smoke and a.ms == "1,16" else [int(m) for m in a.ms.split(",")]
    cuts = {c for c in a.cuts.split(",") if c}
    if not cuts <= {"layer", "model"} or not cuts:
        ap.error(f"--cuts {a.cuts!r}: want layer, model or both")
    with torch.no_grad():
        res = run(ms, max(1, a.rounds), a.smoke, cuts)
    save(a.out, res, t)


if __name__ == "__main__":
    main()
