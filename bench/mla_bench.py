"""The MLA decode op alone (`k3model::mla_decode` at K3's latent widths), one GPU, graphed: the op's
PyTorch reference against the Triton kernel (kernels/triton_mla.py) with its split / tile / warp
settings (tuning.MLA_MIN_CH, MLA_BS, MLA_WARPS), every variant in the same run and checked against
the reference (output and the cache after the write). TP=8 per-rank heads (12), L 512, rope 64, a
cache of --ctx positions + 8 free slots, every row at the full context (the layer bench's case).

    python bench/mla_bench.py [--ms 1,4,16] [--ctx 1024] [--out F]
    python bench/mla_bench.py --uv [--variants "flat:MLA_UV_FLAT=1;..."] [--chs ""]

A variant named chCH_bsBS_wW runs MLA_MIN_CH=CH, MLA_BS=BS, MLA_WARPS=W; "triton" the defaults; each
--variants entry NAME:ATTR=V,... those kernels/tuning.py entries (integers). --uv times the layer's form instead
(k3::mla_decode_uv: the raw kv_a row normalised in the split kernel, then the combine + the value
up-projection W_uv [H, 128, L] + the sigmoid gate), against ops.reference.mla_decode_uv.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import GraphTimer, median, save, with_attrs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--chs", default="32,64,128")
    ap.add_argument("--bss", default="32,64")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--uv", action="store_true", help="the layer's form: k3::mla_decode_uv")
    ap.add_argument("--variants", default="", help="NAME:ATTR=V,ATTR=V;... kernels/tuning.py entries per variant")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from k3compile.kernels import attention, tuning
    from k3compile.model import attention_ops as A
    from k3compile.ops import reference as ref_ops
    t0 = time.time()
    L, R, H, S = 512, 64, a.heads, a.ctx + 8
    rows = []
    for M in (int(m) for m in a.ms.split(",")):
        g = torch.Generator("cuda").manual_seed(M)
        ql = torch.randn(M, H, L, device="cuda", generator=g).bfloat16()
        qr = torch.randn(M, H, R, device="cuda", generator=g).bfloat16()
        kv_new = torch.randn(M, L + R, device="cuda", generator=g).bfloat16()
        cache0 = torch.randn(M, S, L + R, device="cuda", generator=g).bfloat16()
        lens = torch.full((M,), a.ctx, device="cuda", dtype=torch.long)
        c_ref = cache0.clone()
        if a.uv:
            V = 128
            kv_w = (torch.rand(L, device="cuda", generator=g) + 0.5).bfloat16()
            wuv = (torch.randn(H, V, L, device="cuda", generator=g) / L ** 0.5).bfloat16()
            gate = torch.randn(M, H, V, device="cuda", generator=g).bfloat16()

            def reference(c):
                return ref_ops.mla_decode_uv(ql, qr, kv_new, kv_w, 1e-5, c, lens, L ** -0.5, wuv, True, gate)

            def kernel(c):
                return attention.mla_decode(ql, qr, kv_new, c, lens, L ** -0.5, kv_norm=(kv_w, 1e-5), uv=(wuv, True, gate))
        else:
            def reference(c):
                return A.mla_decode_reference(ql, qr, kv_new, c, lens, L ** -0.5)

            def kernel(c):
                return attention.mla_decode(ql, qr, kv_new, c, lens, L ** -0.5)
        ref = reference(c_ref)
        variants = {"reference": {}, "triton": {}}
        if a.chs:
            for ch, bs, w in itertools.product(*(map(int, v.split(",")) for v in (a.chs, a.bss, a.warps))):
                variants[f"ch{ch}_bs{bs}_w{w}"] = {"MLA_MIN_CH": ch, "MLA_BS": bs, "MLA_WARPS": w}
        for spec in filter(None, a.variants.split(";")):
            name, kv = spec.split(":", 1)
            variants[name] = {k: int(v) for k, v in (x.split("=") for x in kv.split(","))}
        timers, err, bad = {}, {}, {}
        for name, attrs in variants.items():
            cache = cache0.clone()
            if name == "reference":
                fn = lambda c=cache: reference(c)  # noqa: E731
            else:
                fn = with_attrs(tuning, lambda c=cache: kernel(c), attrs)
            try:
                out = fn()
                torch.cuda.synchronize()
                err[name] = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                if not torch.equal(cache, c_ref):   # the uv form's normed row may differ by one rounding
                    cerr = (cache.float() - c_ref.float()).abs().max().item()
                    if not a.uv or cerr > 0.05 * c_ref.float().abs().max().item():
                        bad[name] = f"cache differs from the reference's after the write (max {cerr:.3g})"
                timers[name] = GraphTimer(fn)
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is recorded
                bad[name] = f"{type(e).__name__}: {str(e)[:200]}"
        us = {n: [t.time()] for n, t in timers.items()}
        for _ in range(a.rounds - 1):
            for n, t in timers.items():
                us[n].append(t.time())
        row = dict(M=M, H=H, ctx=a.ctx, form="uv" if a.uv else "plain", variants=variants,
                   us={n: median(v) for n, v in us.items()}, err=err, failed=bad)
        rows.append(row)
        best = min((n for n in row["us"] if n != "reference"), key=row["us"].get, default=None)
        print(f"M={M} " + " ".join(f"{n}={v:.2f}" for n, v in row["us"].items())
              + f"  best {best}; max err {max(err.values()):.2e}; failed {bad or 'none'}", flush=True)
    save(a.out, dict(rows=rows, gpu=torch.cuda.get_device_name(), torch=torch.__version__), t0)


if __name__ == "__main__":
    main()
