"""layer_bench --env specs from a gemv_bench sweep run with --dispatch-column: for each swept shape
at M=1 (or --m) whose best config of a kind (--kind, default "gemvl": the LAZY CUDA-core GEMV) beat
what k3 dispatches (the sweep's "k3" column) by at least --margin, one variant forcing that config
(K3_KNOBS gemv_cfg), plus one ("all") forcing every such shape at once. One spec per line, for
`mapfile -t SPECS < <(python3 bench/gemv_env.py SWEEP.json)`; none if nothing beat the dispatch.

    python3 bench/gemv_env.py r/gemv_lazy.json [--kind gemvl] [--m 1] [--margin 0.01] [--name lz]
"""
from __future__ import annotations

import argparse
import json


def specs(rows: list[dict], kind: str, m: int, margin: float, name: str) -> list[str]:
    picks = []
    for r in rows:
        us = r.get("us", {})
        if r["M"] != m or "k3" not in us:
            continue
        mine = {k: v for k, v in us.items() if k.split(" ")[0] == kind}
        if not mine:
            continue
        best = min(mine, key=mine.get)
        if mine[best] <= us["k3"] * (1 - margin):
            picks.append((f"{r['N']}x{r['K']}", best, us["k3"] - mine[best]))
    picks.sort(key=lambda p: -p[2])
    out = [f"{name}{i}:K3_KNOBS=gemv_cfg={shape}={cfg}" for i, (shape, cfg, _) in enumerate(picks)]
    if len(picks) > 1:
        out.append(f"{name}all:K3_KNOBS=gemv_cfg=" + ";".join(f"{shape}={cfg}" for shape, cfg, _ in picks))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sweep")
    ap.add_argument("--kind", default="gemvl")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--margin", type=float, default=0.01)
    ap.add_argument("--name", default="lz")
    a = ap.parse_args()
    for s in specs(json.load(open(a.sweep))["rows"], a.kind, a.m, a.margin, a.name):
        print(s)


if __name__ == "__main__":
    main()
