"""Where the column-split kernels' time goes (triton_cols; one GPU, world 1): each form of the
all-reduce / norm and latent-tail ops at M = 1 and 4 and several column widths, with and without
the grid barrier (SYNC=0: the partials race, the outputs are wrong: timing only), the barrier's
generation word on the arrivals' cache line or 128 bytes away (GEN), the barrier kernel alone, and
the row kernels. CUDA graphs of 20 calls, medians of 30 replays.

    python bench/cols_probe.py --out results.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import GraphTimer, save  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--widths", default="64,128,256")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from k3compile.kernels import comm, tuning
    from tests import simpeers
    from k3compile.kernels import triton_cols
    t0 = time.time()
    rows = []
    bar = torch.zeros(64, dtype=torch.int32, device="cuda")
    for progs in (28, 56, 112):
        for gen in (1, 32):
            us = GraphTimer(lambda: triton_cols.grid_barrier_probe_kernel[(progs,)](bar, GEN=gen, num_warps=4)).time()
            rows.append(dict(case="barrier alone", programs=progs, gen=gen, us=us))
            print(rows[-1], flush=True)
    for M in (int(m) for m in a.ms.split(",")):
        for op in ("resnorm", "tail"):
            run, ref, _ = (simpeers.residual_norm_case(1, M, 3, seed=M) if op == "resnorm" else
                           simpeers.tail_case(1, M, seed=M))
            forms = [("rows", dict(COLS=False), {})]
            for w in (int(x) for x in a.widths.split(",")):
                for probe in ({}, {"SYNC": False}, {"GEN": 1}):
                    forms.append((f"cols w{w} {probe}", dict(COLS=True, COLS_W=w, COLS_MIN_WORLD=1, COLS_MAX_M=4),
                                  probe))
            for name, attrs, probe in forms:
                for k, v in attrs.items():
                    setattr(tuning, k, v)
                comm.COLS_PROBE = probe
                plan = comm.cols_plan(M, 7168 if op == "resnorm" else 3584, 4 if op == "resnorm" else 1, None)
                us = GraphTimer(run).time()
                rows.append(dict(case=op, M=M, form=name, programs=plan.programs if plan else None,
                                 w=plan.w if plan else None, us=us))
                print(rows[-1], flush=True)
            tuning.COLS, tuning.COLS_W, tuning.COLS_MIN_WORLD, tuning.COLS_MAX_M, comm.COLS_PROBE = True, 128, 2, 1, {}
    compiled = []   # registers, spills and shared memory of every compiled form (this machine's Triton)
    for fn in (triton_cols.ar_norm_cols_kernel, triton_cols.latent_tail_cols_kernel):
        try:
            for cache in fn.device_caches.values():
                for key, k in cache[0].items():
                    k._init_handles()
                    compiled.append(dict(kernel=fn.__name__, key=str(key)[-300:], regs=k.n_regs, spills=k.n_spills,
                                         shared=k.metadata.shared))
                    print(compiled[-1], flush=True)
        except Exception as e:  # noqa: BLE001 - Triton's cache layout differs between versions
            print("no compiled-kernel stats:", repr(e))
    save(a.out, dict(rows=rows, compiled=compiled, gpu=torch.cuda.get_device_name(), torch=torch.__version__), t0)


if __name__ == "__main__":
    main()
