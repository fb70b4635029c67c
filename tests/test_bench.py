"""The per-layer benchmark's plumbing on CPU (--smoke: tiny config, TP=1, no timing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_layer_bench_smoke_runs_every_variant(tmp_path):
    """Every variant the GPU run times compiles and runs, and equals eager (Inductor rounds
    differently); the ablation rows include the fused top-k and the CuTe experts (k3-cute)."""
    out = tmp_path / "smoke.json"
    env = dict(os.environ)
    env.pop("K3_CUTE", None)
    subprocess.run([sys.executable, "bench/layer_bench.py", "--smoke", "--ms", "1", "--ablate", "1", "--out",
                    str(out)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    row = json.loads(out.read_text())["rows"][0]
    errs = row["err_vs_eager"]
    for name in ("k3", "k3all", "k3none", "k3-prefetch", "k3-topk", "k3-cute", "k3+fold_moe_finalize",
                 "k3-overlap_shared_expert"):
        assert errs[name] == 0.0, (name, errs)
    assert row["reports"]["k3"]["fold_moe_finalize"][:2] == [1, 1]


def test_bench_env_context_restores_values(monkeypatch):
    """A variant's environment (k3-cute's K3_CUTE=0) is undone for the variants after it."""
    sys.path.insert(0, ROOT)
    from bench.layer_bench import _env
    monkeypatch.setenv("K3_CUTE", "1")
    monkeypatch.delenv("K3_MXFP4", raising=False)
    with _env({"K3_CUTE": "0", "K3_MXFP4": "v3"}):
        assert os.environ["K3_CUTE"] == "0" and os.environ["K3_MXFP4"] == "v3"
    assert os.environ["K3_CUTE"] == "1" and "K3_MXFP4" not in os.environ
