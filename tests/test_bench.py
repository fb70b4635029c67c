"""The per-layer benchmark's plumbing on CPU (--smoke: tiny config, TP=1, no timing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_layer_bench_smoke_runs_every_variant(tmp_path):
    """Every variant the GPU run times compiles and runs, and equals eager (Inductor rounds
    differently); the ablation rows include the fused top-k (its own pass) and the CuTe experts (k3-cute)."""
    out = tmp_path / "smoke.json"
    env = dict(os.environ)
    env.pop("K3_KNOBS", None)
    subprocess.run([sys.executable, "bench/layer_bench.py", "--smoke", "--ms", "1", "--ablate", "1", "--out",
                    str(out)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    row = json.loads(out.read_text())["rows"][0]
    errs = row["err_vs_eager"]
    for name in ("k3", "k3all", "k3none", "k3-prefetch", "k3-fuse_router_topk", "k3-cute", "k3+fold_moe_finalize",
                 "k3-overlap_shared_expert"):
        assert errs[name] == 0.0, (name, errs)
    assert row["reports"]["k3"]["fold_moe_finalize"][:2] == row["reports"]["k3"]["fuse_router_topk"][:2] == [1, 1]
    assert row["cache"] == "random"   # the step starts from a random KDA state: its decay is checked too


def test_layer_bench_env_specs_take_comma_lists():
    """--env NAME:K=V,...: a value may be a comma list (K3_UNGATED's passes)."""
    sys.path.insert(0, ROOT)
    from bench.layer_bench import parse_env
    assert parse_env("fb:K3_UNGATED=fold_kda_gate,fold_kda_fb,K3_KNOBS=kda_fb_bv=16") == \
        ("fb", {"K3_UNGATED": "fold_kda_gate,fold_kda_fb", "K3_KNOBS": "kda_fb_bv=16"})
    assert parse_env("a:K=1") == ("a", {"K": "1"})
    for bad in ("a", "a:", ":K=1", "a:x,K=1", "a:=1", "a:K=1,,"):
        assert parse_env(bad) == (None, None), bad


def test_bench_env_context_restores_values(monkeypatch):
    """A variant's environment (k3-cute's K3_KNOBS=cute=0; bench.common.env, used by the layer and op benches) is
    undone for the variants after it."""
    sys.path.insert(0, ROOT)
    from bench.common import env as _env
    monkeypatch.setenv("K3_KNOBS", "cute=1")
    monkeypatch.delenv("K3_UNGATED", raising=False)
    with _env({"K3_KNOBS": "cute=0,mxfp4=v3", "K3_UNGATED": "fold_kda_gate"}):
        assert os.environ["K3_KNOBS"] == "cute=0,mxfp4=v3" and os.environ["K3_UNGATED"] == "fold_kda_gate"
    assert os.environ["K3_KNOBS"] == "cute=1" and "K3_UNGATED" not in os.environ


def test_report_compares_ablation_rows_with_the_prefetch_free_base_and_lists_pdl():
    """Since the ablation rows run without the L2 prefetch (ablation_base), `all - without` is
    taken against k3-prefetch, except the prefetch row itself (k3all - k3-prefetch); older files
    (no ablation_base) keep k3all. PDL rows get their own table."""
    sys.path.insert(0, ROOT)
    from bench.report import table
    us = {"eager": 300.0, "inductor": 200.0, "k3": 180.0, "k3all": 190.0, "k3none": 210.0, "k3-prefetch": 178.0,
          "k3-fold_moe_finalize": 185.0, "k3+fold_moe_finalize": 200.0, "inductor_pdl": 195.0, "k3_pdl": 170.0}
    row = dict(layer="kda", layer_id=46, shapes="tp8", world=2, M=1, blocks=3, ctx=1024, us=us,
               kernels={"eager": 1, "inductor": 1, "k3": 1}, peak_bytes={"eager": 0, "inductor": 0, "k3": 0},
               err_vs_eager={"k3": 0.0}, floor_us=50.0, speedup_vs_baseline=200 / 180, k3_vs_floor=3.6)
    new = table(dict(rows=[row], ablation_base="k3-prefetch"))
    assert "| 1 | fold_moe_finalize | 200.0 | -10.0 | 185.0 | -7.0 |" in new, new
    assert "| 1 | prefetch |  |  | 178.0 | +12.0 |" in new, new
    assert "| 1 | 195.0 | 180.0 | 195.0 | 1.00x | 170.0 | 1.15x |" in new, new
    old = table(dict(rows=[row]))
    assert "| 1 | fold_moe_finalize | 200.0 | -10.0 | 185.0 | +5.0 |" in old, old
    assert "launch hidden" not in old
    row["us_hidden_launch"] = {"eager": 280.0, "inductor": 190.0, "k3": 172.7}
    row["span_us"] = {"eager": {"one": 281.0, "per_call": 279.5}, "k3": {"one": 171.0, "per_call": 170.2}}
    hid = table(dict(rows=[row]))
    # the --env variants of the command line, beside k3
    row["us"]["fb"], row["us_hidden_launch"]["fb"] = 176.5, 170.0
    row["kernels"]["fb"], row["err_vs_eager"]["fb"] = 16, 0.004
    cmd = "python bench/layer_bench.py --ms 1 --env fb:K3_UNGATED=fold_kda_fb,K3_X=1 --env nope:K=1"
    env = table(dict(rows=[row], command=cmd))
    assert "`fb`: `K3_UNGATED=fold_kda_fb,K3_X=1`" in env and "nope" not in env.split("same run (")[1], env
    assert "| 1 | 180.0 (172.7) | 176.5 (170.0) | -3.5 (-2.7) | 16 / 0.004 |" in env, env
    assert "other environment variables" not in hid
    assert "| 1 | 280.0 | 190.0 | 172.7 | 1.10x | 3.45x | 279.5/-/170.2 |" in hid, hid


def test_gemv_chain_config_from_the_sweep():
    """--chain takes each shape's best swept config at the nearest swept M at or above, BLOCK_K
    capped at K (the PDL GEMV reads one whole tile before it waits)."""
    from bench.gemv_bench import chain_cfg
    sweep = {("tp8 shared_down", 1): (4, 1024, 4, 3), ("tp8 shared_down", 4): (8, 512, 4, 3),
             ("tp8 oproj", 1): (8, 512, 4, 3)}
    assert chain_cfg(sweep, "tp8 shared_down", 1, 768) == (4, 512, 4, 3)
    assert chain_cfg(sweep, "tp8 shared_down", 2, 768) == (8, 512, 4, 3)
    assert chain_cfg(sweep, "tp8 shared_down", 8, 768) == (8, 512, 4, 3)   # above the sweep: its largest M
    assert chain_cfg(sweep, "tp8 oproj", 1, 1536) == (8, 512, 4, 3)


def test_layer_bench_splits_the_error_by_router_margin():
    """A row eager routed on a near tie (margin < ROUTE_TIE) is reported apart: its error does not
    reach the clear rows' maximum, and the clear rows' error is kept whole."""
    import torch
    sys.path.insert(0, ROOT)
    from bench import layer_bench as lb
    a = torch.zeros(3, 4)
    ref = torch.ones(3, 4)
    a[0] = 1.0                 # row 0 exact
    a[1] = 1.5                 # row 1 off by 0.5 (a near tie below)
    a[2, 0] = 0.9              # row 2 off by 0.1 somewhere, and 1.0 elsewhere
    e = lb._row_errs((a,), (ref,), 3)
    assert torch.allclose(e, torch.tensor([0.0, 0.5, 1.0]))
    r = lb._err_by_margin({"k3": e}, torch.tensor([0.5, lb.ROUTE_TIE / 2, 0.3]))
    assert r["near_tie_rows"] == 1 and r["err_vs_eager_clear_rows"]["k3"] == 1.0
    assert r["err_vs_eager_near_tie_rows"]["k3"] == 0.5


def test_gemv_table_keeps_named_shapes_and_stacked_mma_only(tmp_path, monkeypatch):
    """bench/gemv_table.py: a swept shape takes the sweep's best (cuBLAS where none beat it), a --keep
    shape keeps GEMV_TABLE's entry, the stacked router + latent (--mma-only) takes the best MMA config
    even where a CUDA-core GEMV or cuBLAS timed faster; the result reads back through K3_KNOBS gemv_table's
    reader (gemm.gemv_table_from)."""
    from bench import gemv_table
    from k3compile.kernels import gemm, tuning

    def row(shape, n, k, m, us):
        best = min((c for c in us if c != "cublas"), key=us.get)
        return dict(shape=shape, N=n, K=k, M=m, us=us, best=best, speedup_vs_cublas=us["cublas"] / us[best])

    sweep = dict(gpu="test", rows=[
        row("tp8 in_proj_kda", 6284, 7168, 1, {"cublas": 36.0, "gemv 2/1024/4/4": 32.0, "mma 32/256/1/4/4": 33.0}),
        row("tp8 q_b_mla", 2304, 1536, 4, {"cublas": 5.8, "mma 16/256/1/4/4": 6.5}),
        row("tp8 shared_gate_up", 1536, 7168, 1, {"cublas": 12.0, "gemv 2/1024/4/4": 11.0}),
        row("w1 router_latent", 4480, 7168, 1, {"cublas": 25.5, "gemv 4/1024/4/3": 24.0, "mmas 64/128/2/4/4": 25.5,
                                                "mma 32/128/1/4/4": 26.0}),
        row("w1 router_latent", 4480, 7168, 4, {"cublas": 24.9, "mmas 64/128/2/4/4": 25.5}),
    ])
    src, out = tmp_path / "sweep.json", tmp_path / "table.json"
    src.write_text(json.dumps(sweep))
    monkeypatch.setattr(sys, "argv", ["gemv_table.py", str(src), "--keep", "1536x7168", "--out", str(out)])
    gemv_table.main()
    t = gemm.gemv_table_from(str(out))
    assert t[(6284, 7168)][1] == "gemv 2/1024/4/4"
    assert t[(2304, 1536)][4] is None                                  # cuBLAS beat every config
    assert t[(1536, 7168)][1] == tuning.GEMV_TABLE[(1536, 7168)][1]    # kept
    assert t[(4480, 7168)] == {1: "mmas 64/128/2/4/4", 4: "mmas 64/128/2/4/4"}
    assert t[(7168, 1536)] == tuning.GEMV_TABLE[(7168, 1536)]          # not swept: GEMV_TABLE's


def test_gemv_env_forces_only_configs_that_beat_the_dispatch():
    """bench/gemv_env.py: a variant per shape whose best config of the kind beat the k3 column by the
    margin (largest gain first), one forcing them all; other Ms, kinds and near-ties give nothing."""
    from bench.gemv_env import specs
    rows = [dict(N=4480, K=7168, M=1, us={"k3": 24.0, "gemvl 4/1024/4/3": 23.0, "gemvl 8/512/4/3": 23.5,
                                          "gemv 2/1024/4/4": 22.0}),
            dict(N=7168, K=1536, M=1, us={"k3": 9.9, "gemvl 8/512/4/3": 9.4}),
            dict(N=3648, K=7168, M=1, us={"k3": 20.0, "gemvl 4/1024/4/3": 19.9}),   # 0.5%: not enough
            dict(N=6284, K=7168, M=4, us={"k3": 40.0, "gemvl 4/1024/4/3": 30.0}),   # another M
            dict(N=2304, K=1536, M=1, us={"gemvl 2/1024/4/4": 1.0})]                # no k3 column
    assert specs(rows, "gemvl", 1, 0.01, "lz") == [
        "lz0:K3_KNOBS=gemv_cfg=4480x7168=gemvl 4/1024/4/3", "lz1:K3_KNOBS=gemv_cfg=7168x1536=gemvl 8/512/4/3",
        "lzall:K3_KNOBS=gemv_cfg=4480x7168=gemvl 4/1024/4/3;7168x1536=gemvl 8/512/4/3"]
    assert specs(rows[2:], "gemvl", 1, 0.01, "lz") == []
    assert specs(rows[:1], "gemv", 1, 0.01, "g") == ["g0:K3_KNOBS=gemv_cfg=4480x7168=gemv 2/1024/4/4"]
