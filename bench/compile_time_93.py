"""Compile time of the 93-layer K3 structure (tiny widths, attnres block 12), with and without
the K3 passes, through the backend's eager mode (dynamo + AOT + passes; no codegen).

    python bench/compile_time_93.py [--inductor]
"""
from __future__ import annotations

import json
import sys
import time

import torch

import k3compile
from k3compile.model import K3Config, K3Model


def compile_seconds(passes, mode: str) -> tuple[float, object]:
    cfg = K3Config.tiny(dtype="bfloat16", num_layers=93, attnres_block=12, max_seq=8)
    m = K3Model(cfg)
    torch._dynamo.reset()
    k3compile.clear_reports()
    f = torch.compile(m, backend=k3compile.backend(mode=mode, **({} if passes is None else {"passes": passes})), fullgraph=True)
    t = time.perf_counter()
    f(torch.zeros(2, 1, dtype=torch.long), m.new_cache(2))
    return time.perf_counter() - t, k3compile.last_report()


def main() -> dict:
    mode = "inductor" if "--inductor" in sys.argv else "eager"
    base, _ = compile_seconds((), mode)
    full, rep = compile_seconds(None, mode)
    res = dict(mode=mode, without_passes_s=round(base, 2), with_passes_s=round(full, 2),
               overhead=round(full / base - 1, 3), pass_manager_s=round(rep.seconds, 2),
               pass_manager_share=round(rep.seconds / full, 3), report=rep.render())
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
