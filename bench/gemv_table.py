"""A GEMV table for another card from a bench/gemv_bench.py sweep run on it.

    python bench/gemv_table.py SWEEP.json --keep 1536x7168 --out TABLE.json

The script prints, for each swept shape and M, how long kernels/tuning.GEMV_TABLE's config (tuned on
the H200) took in the sweep, against the sweep's best config and cuBLAS.

It then writes TABLE.json in the sweep's row format, so that `K3_KNOBS=gemv_table=TABLE.json` reads it
(gemm.gemv_table_from). Each entry is the sweep's best config where it beat cuBLAS, else cuBLAS.
The shapes named in --keep, and the shapes not swept, keep GEMV_TABLE's entries instead. The shared gate-up is one of them: its
config was picked for the side stream beside the router top-k, not for the GEMM alone.
The shapes named in --mma-only (default: the router + latent down stacked at TP=1, 4480x7168) take the
sweep's best tensor-core ("mma") config, also where cuBLAS timed faster: gemm.mma_gemm2 runs the two stacked weights in one launch only
with an MMA config, and a CUDA-core GEMV config there splits it into two GEMMs. On an H100
the two took 8.0 + 22.5 us of the KDA step's replay against 26.1 stacked
(bench/results/layer_kda_tp8_w1_h100_b8043ff_tab.json, BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _shapes(text: str) -> set:
    return {tuple(int(v) for v in s.split("x")) for s in text.split(",") if s}


def main():
    from k3compile.kernels.tuning import GEMV_TABLE

    ap = argparse.ArgumentParser()
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--keep", default="", help="NxK shapes that keep GEMV_TABLE's entry")
    ap.add_argument("--mma-only", default="4480x7168", help="NxK shapes that take the best MMA config")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    keep = _shapes(a.keep)
    mma_only = _shapes(a.mma_only)
    d = json.loads(a.sweep.read_text())
    rows = []
    for r in d["rows"]:
        shape, m, us = (r["N"], r["K"]), r["M"], r["us"]
        cur = GEMV_TABLE.get(shape, {}).get(m, "absent")
        cur_us = us.get("cublas" if cur in (None, "absent") else cur)
        best_us = us.get(r["best"])
        cur_txt = f"{cur_us:6.2f}" if cur_us is not None else "   -  "
        print(f"{r['shape']:20s} M={m:2d} table {str(cur):20s} {cur_txt} us | sweep best {r['best']:20s} "
              f"{best_us:6.2f} us | cuBLAS {us['cublas']:6.2f} us", flush=True)
        if shape in keep and cur != "absent":
            best, speedup = cur, (2.0 if cur is not None else 0.0)   # gemv_table_from: > 1 keeps `best`
        elif shape in mma_only:
            # even where cuBLAS timed faster on the stacked weight: k3 runs cuBLAS there as two GEMMs
            best = min((c for c in us if c.startswith("mma")), key=us.get, default=None)
            speedup, best_us = (2.0 if best else 0.0), us.get(best)
        else:
            best, speedup = r["best"], r["speedup_vs_cublas"]
        rows.append(dict(shape=r["shape"], N=shape[0], K=shape[1], M=m, best=best, speedup_vs_cublas=speedup,
                         table_us=cur_us, best_us=best_us, cublas_us=us["cublas"]))
    swept = {(r["N"], r["K"]) for r in rows}
    for shape, by_m in GEMV_TABLE.items():   # shapes not swept keep their entries
        if shape not in swept:
            for m, cfg in by_m.items():
                rows.append(dict(shape="%dx%d" % shape, N=shape[0], K=shape[1], M=m, best=cfg,
                                 speedup_vs_cublas=2.0 if cfg is not None else 0.0))
    a.out.write_text(json.dumps(dict(rows=rows, source=str(a.sweep), gpu=d.get("gpu"), keep=sorted(keep)), indent=1))


if __name__ == "__main__":
    main()
