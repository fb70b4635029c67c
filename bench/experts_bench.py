"""MXFP4 routed-expert kernels at real K3 shapes: time, bytes, share of measured HBM bandwidth.

Per-rank shapes of TP=8 (I=384) and TP=2 (I=1536), latent L=3584, 896 experts, top-16, tokens
routed to random distinct experts; M in {1, 4, 16, 64, 256}. Times (CUDA graph, events, median):
  <variant>[tiles] - the Triton kernels (k3::mxfp4_experts' CUDA dispatch), one row per variant
                     (v1, dot, v2b, v3: see k3compile/kernels/triton_moe.py) and tile override;
                     "cute" / "cute_h2": the AOT-built CuTe DSL GEMVs (fp32 / f16x2 math) (k3compile/kernels/cute/mxfp4_experts.py,
                     artifacts in K3_CUTE_DIR, launched by the driver-only loader; no tiles; a
                     missing artifact is reported as an error, not timed as its v3 fallback);
                     "cute_nopdl" / "cute_h2_nopdl": the same, down launched without Programmatic
                     Dependent Launch (K3_KNOBS=cute_pdl=0; the plain names run it, K3_KNOBS=cute_pdl=1);
                     "cute_h2@TAG": a variant of the f16x2 kernels (build.MXFP4_TAGS, alternates
                     built with --alt; "@none": the untagged kernels at every batch);
  reference        - the model op's capture-safe PyTorch path (dequantise each pair's expert + bmm).
Every case runs on the same data and is checked against the reference (first <= 4 tokens); a case
that fails to compile or run is recorded with its error and the bench goes on.
Bytes = the MXFP4 weights and scales of the distinct experts used (what the op must read; with
--cold, the mean over the routings); bandwidth share = bytes / time / measured HBM bandwidth
(bench.common.hbm_bandwidth); `k3_us_hidden_launch` / `hbm_share_hidden_launch`: the same graph timed
with its replay's host launch hidden behind a GPU spin (bench.common.GraphTimer.time). --cold K: K routings used in turn, call by call (the weights a call
reads are then not left in L2 by the call before, as in a model where each layer's experts are
read once per step). --pool N: skewed routing (each token's top-k from one pool of N experts per
routing), where pairs share experts: the bytes to read shrink, the kernels' per-pair work does not.

    python bench/experts_bench.py [--ms 1,4,16,64,256] [--variants v1,dot,v2b] [--sweep] [--pool N]
                                  [--tiles JSON] [--shapes tp8,tp2] [--out results.json]

--tiles: {"variant": [override, ...]} (keys of moe._mxfp4_tiles: BN, BKB_GU, BN_D, BKB_D, BT for
dot; BI, BKB_GU, BL, BKB_D for v1/v2b/v3; LOOP for dot/v2b; BT, FP16 for v3; num_warps, num_stages for all); --sweep
adds SWEEP's.
"""
from __future__ import annotations

import argparse
import json
import os

from k3compile.config import knobs_text  # noqa: E402
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import BW_SEEN, GraphTimer, hbm_bandwidth, save, time_graph  # noqa: E402

L, E, TOPK = 3584, 896, 16
SHAPES = {"tp8": 384, "tp2": 1536}
# tile overrides tried by --sweep (on top of each variant's defaults, which always run)
SWEEP = {
    "dot": [dict(BN=32), dict(BN=16), dict(BKB_GU=128), dict(BKB_GU=32), dict(BN_D=32),
            dict(num_warps=8, BN=128, BN_D=128), dict(LOOP=1, num_stages=3),
            dict(LOOP=1, num_stages=4), dict(LOOP=1, num_stages=4, BKB_GU=128), dict(LOOP=1, num_stages=3, BN=32)],
    "v2b": [dict(BKB_GU=128), dict(BKB_GU=64), dict(num_stages=2), dict(num_warps=2),
            dict(num_warps=8), dict(BI=32), dict(BL=16), dict(BL=64), dict(BKB_D=32), dict(LOOP=1, num_stages=3),
            dict(LOOP=1, num_stages=4, BKB_GU=128), dict(LOOP=1, num_stages=3, BI=32)],
    "v1": [dict(num_warps=2), dict(num_warps=8)],
    # v3: default BI=32 BKB_GU=256 BL=128 BKB_D=64 num_warps=4 num_stages=3 (SASS counts only). Keep
    # 2*BI >= 16*num_warps and BL >= 16*num_warps (64 rows per warpgroup): fewer rows made the
    # SASS dequantise each word twice (BI=16: 10.3 instructions/byte vs 5.9)
    "v3": [dict(BI=64, BKB_GU=128), dict(BI=64, num_warps=8), dict(BI=64, BL=256, num_warps=8),
           dict(num_stages=4), dict(num_stages=2), dict(BKB_GU=128), dict(BL=64), dict(FP16=1)],
}
# max error / max |reference|: the output is rounded to bf16 (2^-9 relative per element) and the
# sums run in another order, so 1e-3 flagged v1 itself; dot also rounds activations to bf16
TOL = {"dot": 2e-2, "v3": 2e-2, "v3g": 2e-2, "cute": 1e-2, "cute_h2": 2e-2}  # v3, v3g too: bf16 activations (the SiTU output rounded)
TOL_DEFAULT = 1e-2


def expert_weights(I: int):
    """Random MXFP4 experts [E, ...] at per-rank width I on CUDA: every code, scales 2^-9 .. 2^-4."""
    import torch
    w13 = torch.randint(0, 256, (E, 2 * I, L // 2), dtype=torch.uint8, device="cuda")
    s13 = torch.randint(118, 124, (E, 2 * I, L // 32), dtype=torch.uint8, device="cuda")
    w2 = torch.randint(0, 256, (E, L, I // 2), dtype=torch.uint8, device="cuda")
    s2 = torch.randint(118, 124, (E, L, I // 32), dtype=torch.uint8, device="cuda")
    return w13, s13, w2, s2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16,64,256")
    ap.add_argument("--variants", default="v1,dot,v2b")
    ap.add_argument("--shapes", default="tp8,tp2")
    ap.add_argument("--sweep", action="store_true", help="also time SWEEP's tile overrides")
    ap.add_argument("--tiles", default=None, help='JSON {"variant": [overrides, ...]}, added to the cases')
    ap.add_argument("--no-reference-time", action="store_true")
    ap.add_argument("--cold", type=int, default=1,
                    help="rotate through this many routings (different random experts) call by call, so that "
                         "the experts a call reads are not in L2 from the call before (1: the same routing "
                         "every call: at M=1 its 35 MB of TP=8 experts can stay in the L2)")
    ap.add_argument("--pool", type=int, default=0,
                    help="skewed routing: every token picks its top-k from one random pool of this many "
                         "experts (0: from all of them); bytes are still the distinct experts' only")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from k3compile.kernels import moe
    from k3compile.kernels.cute import artifacts
    from k3compile.model.moe_ops import mxfp4_experts_gathered
    variants = [v for v in a.variants.split(",") if v]
    extra = json.loads(a.tiles) if a.tiles else {}
    cases = []
    for v in variants:
        cases.append((v, None))
        for t in (SWEEP.get(v, []) if a.sweep else []) + extra.get(v, []):
            cases.append((v, t))
    torch.manual_seed(0)
    bw = hbm_bandwidth()
    rows = []
    for shape in a.shapes.split(","):
        I = SHAPES[shape]
        w13, s13, w2, s2 = expert_weights(I)
        per_expert = (w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel())
        for M in [int(m) for m in a.ms.split(",")]:
            keep = []
            x = torch.randn(M, L, device="cuda").to(torch.bfloat16)
            pools = [torch.randperm(E, device="cuda")[:a.pool or E] for _ in range(a.cold)]
            routings = [torch.stack([pool[torch.randperm(pool.numel(), device="cuda")[:TOPK]] for _ in range(M)])
                        .to(torch.int32) for pool in pools]
            ids = routings[0]
            turn = iter(range(1 << 62))
            distinct = sum(int(torch.unique(r).numel()) for r in routings) / a.cold   # per call, on average
            nbytes = distinct * per_expert
            sub = slice(0, min(M, 4))  # the reference on a few tokens (it materialises fp32 weights)
            want = mxfp4_experts_gathered(x[sub], ids[sub], w13, s13, w2, s2, 4.0, 25.0).float()
            ref = lambda: mxfp4_experts_gathered(x, ids, w13, s13, w2, s2, 4.0, 25.0)  # noqa: E731
            t_ref = (time_graph(ref, reps=2, iters=5)
                     if M * I <= 16 * 384 and not a.no_reference_time else None)  # it materialises fp32 weights
            base = dict(shapes=shape, M=M, I=I, distinct_experts=distinct, bytes=nbytes, reference_us=t_ref,
                        floor_us=nbytes / bw * 1e6, cold=a.cold, pool=a.pool or E)
            for v, tiles in cases:
                label = v + (json.dumps(tiles, separators=(",", ":")) if tiles else "")
                row = dict(base, variant=v, tiles=tiles, label=label)
                # "<cute variant>_nopdl": the same artifacts launched without Programmatic Dependent Launch;
                # "cute_h2@TAG": a variant of the f16x2 kernels (build.MXFP4_TAGS; "none": untagged)
                v, _, tag = v.partition("@")
                os.environ["K3_KNOBS"] = knobs_text(cute_pdl="0" if v.endswith("_nopdl") else "1")
                if tag:
                    os.environ["K3_KNOBS"] = knobs_text(cute_mxfp4_tag=tag)
                else:                       # dispatch's own choice (moe.mxfp4_tag)
                    os.environ["K3_KNOBS"] = knobs_text(cute_mxfp4_tag="")
                v = v.removesuffix("_nopdl")
                try:
                    if not moe.mxfp4_experts_ok(x, ids, w13, variant=v, tiles=tiles):
                        raise ValueError("mxfp4_experts_ok: shapes do not fit these tiles")
                    fn = lambda v=v, tiles=tiles, r=None: moe.mxfp4_experts(  # noqa: E731
                        x, routings[next(turn) % a.cold] if r is None else r, w13, s13, w2, s2, 4.0, 25.0,
                        variant=v, tiles=tiles)
                    if v.startswith("cute"):  # the AOT CuTe artifacts (K3_CUTE_DIR); a silent v3 fallback is an error here
                        artifacts._WHY.clear()
                    # the output buffer must not hold an earlier variant's (correct) result: keep
                    # those alive and leave a NaN-filled block of this size for the allocator to
                    # reuse, so rows a kernel never writes fail the check (the dn2x down that could
                    # read mid too early passed it at M=4 in one run: the race, or stale memory)
                    torch.full((M, TOPK, L), float("nan"), dtype=x.dtype, device="cuda")
                    out = fn(r=ids)
                    keep.append(out)
                    torch.cuda.synchronize()
                    if v.startswith("cute") and artifacts.fallbacks():
                        raise RuntimeError(f"cute fell back to {moe.CUTE_FALLBACK}: {artifacts.fallbacks()}")
                    err = ((out[sub].float() - want).abs().max() / want.abs().max()).item()
                    timer = GraphTimer(fn)
                    t = timer.time(30)
                    th = timer.time(30, hide_launch=True)   # the replay's host launch hidden (GraphTimer.time)
                    row.update(k3_us=t, err_vs_reference=err, correct=bool(err <= TOL.get(v, TOL_DEFAULT)),
                               k3_bytes_per_s=nbytes / (t * 1e-6), hbm_share=nbytes / (t * 1e-6) / bw,
                               k3_us_hidden_launch=th, hbm_share_hidden_launch=nbytes / (th * 1e-6) / bw)
                    print(f"experts {shape} M={M:<4} {label:<40} {t:8.1f}us ref={t_ref or float('nan'):9.1f}us "
                          f"{nbytes / 1e6:7.1f} MB {row['k3_bytes_per_s'] / 1e12:.2f} TB/s = "
                          f"{row['hbm_share'] * 100:3.0f}% of {bw / 1e12:.2f} TB/s (launch hidden: {th:.1f}us, "
                          f"{row['hbm_share_hidden_launch'] * 100:3.0f}%) err {err:.2e}"
                          f"{'' if row['correct'] else ' WRONG'}", flush=True)
                except Exception as exc:  # a variant that does not compile / run here: record, go on
                    row.update(error=f"{type(exc).__name__}: {exc}"[:2000])
                    print(f"experts {shape} M={M:<4} {label:<40} FAILED {row['error'][:300]}", flush=True)
                    try:
                        torch.cuda.synchronize()
                    except Exception:
                        pass
                rows.append(row)
    best = {}
    for r in rows:
        if r.get("correct") and r["k3_us"] < best.get((r["shapes"], r["M"]), (1e30,))[0]:
            best[(r["shapes"], r["M"])] = (r["k3_us"], r["label"])
    for (shape, M), (t, label) in best.items():
        print(f"best {shape} M={M:<4} {label} {t:.1f}us")
    save(a.out, dict(rows=rows, best={f"{s} M={m}": dict(us=t, label=lab) for (s, m), (t, lab) in best.items()},
                     hbm_bytes_per_s=bw, bw_seen=BW_SEEN, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                     triton=__import__("triton").__version__))

if __name__ == "__main__":
    main()
