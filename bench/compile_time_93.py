"""Compile time of the 93-layer K3 structure (tiny widths, attnres block 12), with and without
the K3 passes, through the backend's eager mode (dynamo + AOT + passes; no codegen) or Inductor.

    python bench/compile_time_93.py [--inductor] [--device cuda] [--no-fallbacks] [--out F]

--no-fallbacks: the pass manager does not register the k3 ops with Inductor first (Inductor's
implicit fallback path then runs for each, with its operator_str log: eager in torch 2.11).
Inductor's caches are off, so every compile is cold.
"""
from __future__ import annotations

import json
import sys
import time

import torch

import k3compile
from k3compile.model import K3Config, K3Model


def compile_seconds(passes, mode: str, device: str = "cpu") -> tuple[float, object]:
    cfg = K3Config.tiny(dtype="bfloat16", num_layers=93, attnres_block=12, max_seq=8)
    m = K3Model(cfg, device=device)
    torch._dynamo.reset()
    k3compile.clear_reports()
    f = torch.compile(m, backend=k3compile.backend(mode=mode, **({} if passes is None else {"passes": passes})), fullgraph=True)
    t = time.perf_counter()
    with torch._inductor.config.patch(force_disable_caches=True):
        f(torch.zeros(2, 1, dtype=torch.long, device=device), m.new_cache(2))
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, k3compile.last_report()


def main() -> dict:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-fallbacks", action="store_true")
    ap.add_argument("--with-passes-only", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    mode = "inductor" if a.inductor else "eager"
    if a.no_fallbacks:
        from k3compile.passes import manager
        manager.register_inductor_fallbacks = lambda: 0
    base = float("nan") if a.with_passes_only else compile_seconds((), mode, a.device)[0]
    full, rep = compile_seconds(None, mode, a.device)
    res = dict(mode=mode, device=a.device, torch=torch.__version__, fallbacks_registered=not a.no_fallbacks,
               gpu=torch.cuda.get_device_name() if a.device == "cuda" else None,
               command="python " + " ".join(sys.argv), date=time.strftime("%Y-%m-%d"),
               without_passes_s=round(base, 2), with_passes_s=round(full, 2),
               overhead=round(full / base - 1, 3), pass_manager_s=round(rep.seconds, 2),
               pass_manager_share=round(rep.seconds / full, 3), report=rep.render())
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return res


if __name__ == "__main__":
    main()
