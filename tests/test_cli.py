"""The k3c CLI: each subcommand's output and exit code.

Commands run in-process through typer's CliRunner at TP=1 in the backend's eager mode, except
one real subprocess of the installed `k3c` console script (TP=2: two gloo ranks, TORCH_TRACE on).
Planted faults, test-only (monkeypatches; nothing in the package knows about them):
- a numerics bug: the fused MoE tail's reference scaled by 1.05, which `bisect` must name;
- a near-miss: the MLA attention output multiplied by 1.0 before the residual add, which
  `explain` must show with the node where matching stopped, the reason and the source line.
Tolerance: in eager mode the rewritten graph runs the same ops as the original, so every error
without a planted bug is exactly 0.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from typer.testing import CliRunner

import k3compile
from k3compile.cli import app
from k3compile.model import K3Config
from k3compile.options import PASS_ORDER


# passes with nothing to do on the reference model (its experts are an expert op), and their skip reason
NOT_APPLICABLE = {"lower_mxfp4_experts": "no plain-torch experts to lower"}
FINALIZE_AT = PASS_ORDER.index("fold_moe_finalize") + 1   # its dump files' number


def k3c(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def ok(r):
    assert r.exit_code == 0 and r.exception is None, (r.exit_code, r.output, r.exception)
    return r.output


def row(out: str, name: str) -> list[str]:
    """The table row of one pass (or "(no K3 pass)"), split into its cells."""
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) > 1 and cells[1] == name:
            return cells
    raise AssertionError(f"no row for {name} in:\n{out}")


def match_report(rep: dict) -> dict:
    """What must survive a round trip: per pass sites, skips, errors, near-misses, node counts."""
    return {p["name"]: (p["matched"], p["expected"], p["skipped"], p["error"],
                        [(nm["site"], nm["stopped_at"], nm["reason"]) for nm in p["near_misses"]],
                        p["nodes_before"], p["nodes_after"]) for p in rep["passes"]}


def plant_numerics_bug(monkeypatch):
    import k3compile.ops.reference as ref
    orig = ref.moe_latent_tail
    monkeypatch.setattr(ref, "moe_latent_tail", lambda *a: orig(*a) * 1.05)


def plant_near_miss(monkeypatch):
    from k3compile.model import layers
    orig = layers.MLA.forward

    def forward(self, *a, **kw):
        return orig(self, *a, **kw) * 1.0  # an extra op between the o-proj and the residual add
    monkeypatch.setattr(layers.MLA, "forward", forward)


TINY = K3Config.tiny()


@pytest.fixture(scope="module")
def tiny_dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3c") / "dump"
    return k3c("run", "--tp", 1, "--dump", d), d


# ------------------------------------------------------------------------------------ passes
def test_passes_lists_each_pass_pattern_state_and_batch_range():
    from k3compile.options import K3Options
    from k3compile.passes.manager import PASSES
    ranges = K3Options.make().m_ranges
    rng = {n: f"{lo}\\.\\.{'any' if hi >= 1 << 30 else hi}" for n, (lo, hi) in ranges.items()}
    out = ok(k3c("passes", "--skip", "overlap_shared_expert"))
    for name, p in PASSES.items():
        line = next(ln for ln in out.splitlines() if re.match(rf"\s*\d+\s+{name}\b", ln))
        on = "no" if name == "overlap_shared_expert" else "yes"
        assert re.search(rf"\b{on}\s+{rng[name]}\s*$", line), line
        assert p.emits.split(",")[0] in out and p.pattern.split(" ")[0] in line
    out = ok(k3c("passes", env={"K3_SKIP": "fold_moe_finalize"}))
    assert "enabled set from the environment: K3_SKIP=fold_moe_finalize" in out
    assert re.search(rf"fold_moe_finalize .* no\s+{rng['fold_moe_finalize']}", out)
    out = ok(k3c("passes", "-v"))
    assert "Matches, once per MoE layer" in out  # the passes' module docstrings


# ------------------------------------------------------------------------------------ run + dump
def test_run_tp1_table_matches_report_and_dump_has_every_file(tiny_dump):
    r, d = tiny_dump
    out = ok(r)
    summary = json.loads((d / "summary.json").read_text())
    rep = summary["report"]
    want = dict(attention_layers=TINY.num_layers, moe_layers=len(TINY.moe_layers), tp=1, m=2, dtype="bfloat16",
                device="cpu", residual_adds=2 * TINY.num_layers, routers=len(TINY.moe_layers), unclassified=None,
                moe_ops=[])
    assert rep["structure"] == want
    assert row(out, "(no K3 pass)")[-2:] == ["0", "0"]
    for i, p in enumerate(rep["passes"], 1):
        cells = row(out, p["name"])
        if p["name"] in NOT_APPLICABLE:   # nothing of its kind in the tiny model: skipped, says why
            assert p["skipped"] and NOT_APPLICABLE[p["name"]] in p["skipped"], p
            continue
        assert p["matched"] == p["expected"] > 0
        assert cells[2] == f"{p['matched']}/{p['expected']}"
        assert cells[3] == f"{p['nodes_before']} → {p['nodes_after']}"
        # fewer nodes after every pass but pair_pdl, which only sets arguments of the ops already there
        assert (p["nodes_after"] == p["nodes_before"]) if p["name"] == "pair_pdl" else p["nodes_after"] < p["nodes_before"]
        assert cells[4].endswith(" ms") and cells[-2:] == ["0", "0"]  # eager mode is exact
        before = (d / f"{i:02d}_{p['name']}.before.py").read_text()
        after = (d / f"{i:02d}_{p['name']}.after.py").read_text()
        op = k3compile.passes.manager.PASSES[p["name"]].emits.split(",")[0].replace("::", ".")
        # what the pass puts in the graph: its op, or (a pass that adds arguments to an op already there) them
        mark = {"fold_kda_onorm": "o_norm = ", "pair_pdl": "after_trigger = True"}.get(p["name"], f"torch.ops.{op}")
        assert mark in after and mark not in before, (p["name"], mark)
    by = {p["name"]: p for p in rep["passes"]}
    assert by["fuse_router_topk"]["expected"] == by["fold_moe_finalize"]["expected"] == len(TINY.moe_layers)
    assert by["fuse_oproj_allreduce"]["expected"] == TINY.num_layers
    assert [s["rel"] for s in summary["numerics"]] == [0.0] * (1 + len(PASS_ORDER))
    assert "next tokens (all passes on)" in out and "= eager's" in out
    assert (d / "graph.json").exists() and (d / "graph.inputs.pt").exists()
    svgs = sorted((d / "svg").glob("layer_*.svg"))
    assert [f.name for f in svgs] == sorted(f"layer_{i:02d}.{t}.svg" for i in range(TINY.num_layers)
                                            for t in ("before", "after"))
    for f in svgs:
        root = ET.fromstring(f.read_text())  # well-formed SVG
        fused = [e for e in root.iter("{http://www.w3.org/2000/svg}rect") if e.get("fill") == "#ffb000"]
        # the legend has one amber box; an after-picture has the fused ops of its layer too
        assert len(fused) == 1 if ".before." in f.name else len(fused) >= 2, f.name
    assert "layer_03.after.svg" in (d / "svg" / "index.html").read_text()


def test_round_trip_dumped_graph_gives_the_same_match_report(tiny_dump, tmp_path):
    _, d = tiny_dump
    out = ok(k3c("run", "--graph", d / "graph.json", "--dump", tmp_path / "again"))  # data: no --trust-code
    first = json.loads((d / "summary.json").read_text())["report"]
    second = json.loads((tmp_path / "again" / "summary.json").read_text())["report"]
    assert match_report(second) == match_report(first)
    assert second["structure"] == first["structure"]
    assert row(out, "overlap_shared_expert")[-2:] == ["0", "0"]  # numerics from the saved inputs


def test_python_graph_needs_trust_code_then_matches(tiny_dump, tmp_path):
    _, d = tiny_dump
    py = d / f"{FINALIZE_AT:02d}_fold_moe_finalize.before.py"
    r = k3c("run", "--graph", py)
    assert r.exit_code == 1 and "executes its code" in r.stderr and "--trust-code" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # TORCH_COMPILE_DEBUG's readable dumps name the class `<lambda>`
    lam = tmp_path / "fx_graph_readable.py"
    lam.write_text(py.read_text().replace("class GraphModule(", "class <lambda>(", 1))
    for f in (py, lam):
        out = ok(k3c("run", "--graph", f, "--trust-code", "--dump", tmp_path / f.stem))
        assert row(out, "fold_moe_finalize")[2] == f"{len(TINY.moe_layers)}/{len(TINY.moe_layers)}"
        assert row(out, "fuse_oproj_allreduce")[2] == f"{TINY.num_layers}/{TINY.num_layers}"
        assert "numerics not checked" in out
    # no module paths in a readable graph: the pictures split it at the attention cores instead
    assert "segment 3 (up to attention core 3)" in (tmp_path / lam.stem / "svg" / "index.html").read_text()


def test_runnable_repro_with_load_args_loads(tmp_path):
    """TORCH_COMPILE_DEBUG's fx_graph_runnable.py form: a Repro module and load_args(reader)."""
    f = tmp_path / "fx_graph_runnable.py"
    f.write_text(
        "import torch\nfrom torch import device\n"
        "class Repro(torch.nn.Module):\n"
        "    def forward(self, arg0_1, arg1_1):\n"
        "        mm = torch.ops.aten.mm.default(arg0_1, arg1_1)\n"
        "        return (torch.ops.aten.relu.default(mm),)\n"
        "def load_args(reader):\n"
        "    buf0 = reader.storage(None, 1024, dtype_hint=torch.bfloat16)\n"
        "    reader.tensor(buf0, (4, 64), dtype=torch.bfloat16, is_leaf=True)  # arg0_1\n"
        "    buf1 = reader.storage(None, 8192, dtype_hint=torch.bfloat16)\n"
        "    reader.tensor(buf1, (64, 32), dtype=torch.bfloat16, is_leaf=True)  # arg1_1\n"
        "if __name__ == '__main__':\n    raise SystemExit('not run on load')\n")
    out = ok(k3c("run", "--graph", f, "--trust-code"))
    assert "nothing matched: no K3 structure found" in out


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.export's own pytree deprecation notices
def test_pt2_export_program(tmp_path):
    from k3compile.model import K3Model

    class Step(torch.nn.Module):
        """One decode step with the cache tensors as inputs (what torch.export takes)."""

        def __init__(self, model):
            super().__init__()
            self.model, self.template = model, model.new_cache(2)

        def forward(self, ids, *cache):
            import copy
            c, it = copy.copy(self.template), iter(cache)
            c.conv = {i: next(it) for i in self.template.conv}
            c.state = {i: next(it) for i in self.template.state}
            c.kv = {i: next(it) for i in self.template.kv}
            c.seq_lens = next(it)
            return self.model(ids, c)

    cfg = K3Config.tiny(dtype="bfloat16", num_layers=2)
    m = K3Model(cfg)
    ids = torch.randint(0, cfg.vocab, (2, 1), generator=torch.Generator().manual_seed(0))
    ep = torch.export.export(Step(m), (ids, *m.new_cache(2).tensors()))
    torch.export.save(ep, tmp_path / "step.pt2")
    out = ok(k3c("run", "--graph", tmp_path / "step.pt2"))
    assert "(torch.export graph)" in out
    assert row(out, "fold_moe_finalize")[2] == "1/1" and row(out, "fuse_oproj_allreduce")[2] == "2/2"
    assert row(out, "overlap_shared_expert")[2:3] == ["1/1"] and row(out, "overlap_shared_expert")[-2:] == ["0", "0"]


@pytest.mark.parametrize("model,attention", [("layer-kda", "KDA"), ("layer-mla", "MLA")])
def test_one_layer_models(model, attention):
    out = ok(k3c("run", "--model", model, "--tp", 1))
    assert f"{attention} attention + LatentMoE" in out and "1 attention layer, 1 MoE layer" in out
    for p in ("fold_moe_finalize", "fuse_oproj_allreduce", "overlap_shared_expert"):
        assert row(out, p)[2] == "1/1" and row(out, p)[-2:] == ["0", "0"], out


# ------------------------------------------------------------------------------------ diff
@pytest.mark.slow
def test_diff_is_coloured_and_names_the_new_ops(tiny_dump, tmp_path):
    _, d = tiny_dump
    plain = ok(k3c("diff", d, "fold_moe_finalize"))
    header = plain.splitlines()[0]
    for op in ("k3::moe_latent_tail", "k3::mxfp4_experts"):  # the fused tail, the lowered expert op
        assert f"{op} ×{len(TINY.moe_layers)}" in header.split("new: ")[1], header
    assert "\x1b[" not in plain
    assert f"+++ {FINALIZE_AT:02d}_fold_moe_finalize.after.py" in plain and "# File:" not in plain
    out = ok(k3c("diff", d, "fold_moe_finalize", env={"FORCE_COLOR": "1", "TERM": "xterm"}))
    assert re.search(r"\x1b\[32m\+ .*torch\.ops\.k3\.moe_latent_tail\.default\(", out)  # green additions
    assert re.search(r"\x1b\[31m- .*torch\.ops\.aten\.sum\.dim_IntList", out)         # red removals
    assert "# File:" in ok(k3c("diff", d, "fold_moe_finalize", "--comments"))
    assert "k3::router_latent_sharded ×" in ok(k3c("diff", d, "shard_router_latent")).splitlines()[0]
    ok(k3c("run", "--tp", 1, "--skip", "shard_router_latent", "--dump", tmp_path / "d2"))
    r = k3c("diff", tmp_path / "d2", "shard_router_latent")
    assert r.exit_code == 1 and "did not change the graph in this dump (disabled by options" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------ explain
def test_explain_shows_every_planted_near_miss(monkeypatch, tiny_dump):
    plant_near_miss(monkeypatch)
    out = ok(k3c("explain", "fuse_oproj_allreduce", "--model", "layer-mla", "--tp", 1))
    assert "0/1 sites (1 missed)" in out
    assert re.search(r"1\. site \S+ in layers\.3\.attn: matching stopped at mm_\d+", out), out
    assert re.search(r"node: +mm_\d+ = aten\.mm\.default\(", out)
    assert re.search(r"why: +o-proj result is not added to the residual exactly once \(users: mul\.Tensor", out)
    assert re.search(r"source: .*k3compile/model/layers\.py:\d+: return all_reduce\(F\.linear\(o\.reshape", out)
    assert "2. site" not in out
    r = k3c("run", "--model", "layer-mla", "--tp", 1, "--strict")
    assert r.exit_code == 1 and "--strict" in r.stderr
    assert row(r.stdout, "fuse_oproj_allreduce")[2] == "0/1"
    assert "fuse_oproj_allreduce: 1 near-miss" in r.stdout and "k3c explain fuse_oproj_allreduce" in r.stdout
    # from a dump: the clean tiny run has none
    out = ok(k3c("explain", "fold_moe_finalize", tiny_dump[1]))
    assert f"no near-misses: all {len(TINY.moe_layers)} expected sites matched" in out


# ------------------------------------------------------------------------------------ bisect
def test_bisect_names_the_planted_numerics_bug(monkeypatch):
    out = ok(k3c("bisect", "--model", "layer-kda", "--tp", 1))
    assert "every prefix is within tol 0.01" in out
    assert [row(out, n)[-1] for n in ["(no K3 pass)"] + [f"+ {p}" for p in PASS_ORDER]] == \
        ["ok"] + ["skipped: graph unchanged" if p in NOT_APPLICABLE else "ok" for p in PASS_ORDER]
    plant_numerics_bug(monkeypatch)
    r = k3c("bisect", "--model", "layer-kda", "--tp", 1)
    assert r.exit_code == 1, r.output
    assert "first pass past tolerance: fold_moe_finalize" in r.stdout
    assert row(r.stdout, "(no K3 pass)")[-1] == "ok"
    assert row(r.stdout, "+ fold_moe_finalize")[-1] == "past tol"
    assert "fold_moe_finalize alone (no other pass)" in r.stdout and "wrong by itself" in r.stdout
    assert "every prefix is within tol" in ok(k3c("bisect", "--model", "layer-kda", "--tp", 1, "--tol", 0.2))


def test_prefix_errors_equal_a_separate_compile_per_prefix(monkeypatch):
    """The CLI traces once and swaps in the graph after pass k; a compile with passes 1..k must
    give the same logits, bit for bit."""
    from k3compile.cli.engine import MODELS, RunSpec, build_config, decode_inputs, run_model
    from k3compile.model import K3Model
    plant_numerics_bug(monkeypatch)
    spec = RunSpec(model="layer-kda", tp=1)
    stages = {s["after"]: s for s in run_model(0, 1, spec)["stages"]}
    torch._dynamo.reset()
    model = K3Model(build_config(spec), layers=MODELS["layer-kda"].layers)
    ids, fresh = decode_inputs(model, spec)
    ref = model(ids, fresh())
    for prefix in (("fold_moe_finalize",), ("fold_moe_finalize", "fuse_oproj_allreduce")):
        torch._dynamo.reset()
        f = torch.compile(model, backend=k3compile.backend(mode="eager", passes=prefix), fullgraph=True)
        diff = (f(ids, fresh()) - ref).abs().max().item()
        assert diff > 0 and diff == stages[prefix[-1]]["abs"], (prefix, diff, stages[prefix[-1]])


# ------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("args,code,message", [
    (["run", "--passes", "fuse_everything"], 2, "unknown pass fuse_everything in --passes; valid passes: "
                                                "shard_router_latent, fuse_router_topk"),
    (["run", "--skip", "a,b"], 2, "unknown passes a, b in --skip"),
    (["explain", "fuse"], 2, "unknown pass 'fuse'; valid passes: shard_router_latent"),
    (["run", "--tp", 3], 2, "bad TP size: TP size 3 does not divide kda_heads=4"),
    (["run", "--tp", 0], 2, "--tp must be >= 1"),
    (["bisect", "--batch", 0], 2, "--batch must be >= 1"),
    (["run", "--graph", "g.json", "--model", "tiny"], 2, "--graph and --model exclude each other"),
    (["run", "--graph", "missing.json"], 1, "missing.json: no such file"),
    (["run", "--graph", "GARBAGE.json"], 1, "not a JSON graph"),
    (["run", "--graph", "GARBAGE.pt2"], 1, "cannot load as a .pt2 graph"),
    (["run", "--graph", "GARBAGE.txt"], 1, "unknown graph format '.txt'"),
    (["run", "--graph", "GARBAGE.py", "--trust-code"], 1, "cannot load as a .py graph"),
    (["run", "--graph", "GARBAGE.py", "--trust-code", "--sym", "s0"], 2, "--sym takes NAME=N"),
    (["run", "--graph", "EVIL.json"], 1, "names a Python function that k3c does not load"),
    (["run", "--graph", "g.json", "--inductor"], 2, "--inductor has no effect with --graph"),
    (["diff", "missing-dir", "fold_moe_finalize"], 1, "missing-dir: no such directory"),
    (["explain", "fold_moe_finalize", "GARBAGE.txt"], 1, "no such directory"),
])
def test_errors_are_one_line_with_a_nonzero_exit_code(tmp_path, monkeypatch, args, code, message):
    monkeypatch.chdir(tmp_path)
    for name in ("GARBAGE.json", "GARBAGE.pt2", "GARBAGE.txt"):
        (tmp_path / name).write_bytes(b"\x00\x01 not a graph")
    (tmp_path / "GARBAGE.py").write_text("x = (\n")
    # a .json graph is data: a target outside torch.ops and Python's operators is refused, not run
    (tmp_path / "EVIL.json").write_text(json.dumps({"format": "k3c-graph", "version": 1, "nodes": [
        {"name": "x", "op": "placeholder", "target": "x", "args": {"tuple": []}, "kwargs": {"dict": {}}},
        {"name": "y", "op": "call_function", "target": {"py": "os.system"}, "args": {"tuple": ["true"]},
         "kwargs": {"dict": {}}}]}))
    r = k3c(*args)
    assert r.exit_code == code, (r.exit_code, r.output)
    assert message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("k3c: error: ")


def test_unknown_model_lists_the_valid_ones():
    r = k3c("run", "--model", "huge")
    assert r.exit_code == 2 and "'huge' is not one of 'tiny', 'small', 'layer-kda', 'layer-mla'" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line():
    r = k3c("run", "--device", "cuda")
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "no CUDA GPU is visible to PyTorch" in r.stderr


# ------------------------------------------------------------------------------------ bad arguments, up front
def refused(r, message: str, code: int = 2) -> None:
    """One line on stderr, nothing on stdout (no run, no progress), the exit code of a bad argument."""
    assert r.exit_code == code, (r.exit_code, r.output)
    assert r.stderr.startswith("k3c: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert message in r.stderr and "Traceback" not in r.output, r.stderr
    assert r.stdout == "", r.stdout


@pytest.fixture
def no_run(monkeypatch):
    """Fail the command if it gets as far as running a model or a graph."""
    from k3compile.cli import engine

    def ran(*a, **kw):
        raise AssertionError("ran before refusing the arguments")
    monkeypatch.setattr(engine, "run_model", ran)
    monkeypatch.setattr(engine, "run_graph", ran)


def tp2_dump(tiny_dump, d):
    """A TP=2 dump's layout (rank0/, rank1/) from the TP=1 dump, without a two-rank run."""
    for rank in (0, 1):
        shutil.copytree(tiny_dump[1], d / f"rank{rank}")
    return d


@pytest.mark.parametrize("cmd", ["run", "bisect"])
@pytest.mark.parametrize("tol", ["-1", "nan", "inf", "-inf"])
def test_bad_tol_is_refused(no_run, cmd, tol):
    refused(k3c(cmd, "--tp", 1, "--tol", tol), f"--tol must be a finite number >= 0, got {tol}")


def test_empty_dump_is_refused(no_run):
    refused(k3c("run", "--tp", 1, "--dump", ""), "--dump needs a directory name")


def test_negative_diff_context_is_refused(tiny_dump):
    refused(k3c("diff", tiny_dump[1], "fold_moe_finalize", "-U", -1), "--context must be >= 0, got -1")


@pytest.mark.parametrize("args", [["run", "--tp", 1], ["bisect", "--tp", 1], ["explain", "fold_moe_finalize"],
                                  ["explain", "fold_moe_finalize", "DUMP"], ["diff", "DUMP", "fold_moe_finalize"]])
def test_negative_rank_is_refused(no_run, tiny_dump, args):
    args = [tiny_dump[1] if a == "DUMP" else a for a in args]
    refused(k3c(*args, "--rank", -1), "--rank must be >= 0, got -1")


def test_rank_out_of_range_names_the_ranks_of_the_dump(tiny_dump, tmp_path):
    d = tp2_dump(tiny_dump, tmp_path / "tp2")
    for args in (["diff", d, "fold_moe_finalize"], ["explain", "fold_moe_finalize", d], ["run", "--graph", d]):
        refused(k3c(*args, "--rank", 5), f"--rank 5 is out of range for {d}: the dump has ranks 0, 1")
    assert "fold_moe_finalize: " in ok(k3c("diff", d, "fold_moe_finalize", "--rank", 1)).splitlines()[0]
    refused(k3c("diff", tiny_dump[1], "fold_moe_finalize", "--rank", 1), "the dump has rank 0 only")
    refused(k3c("run", "--graph", tiny_dump[1] / "graph.json", "--rank", 1), "rank 1 is out of range for TP=1")


def test_dump_target_is_checked_before_running(no_run, tiny_dump, tmp_path):
    f = tmp_path / "passwd"
    f.write_text("root:x:0:0\n")
    refused(k3c("run", "--tp", 1, "--dump", f), f"--dump {f}: {f} is a file, not a directory")
    refused(k3c("run", "--tp", 1, "--dump", f / "sub"), f"{f} is a file, not a directory")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    refused(k3c("run", "--tp", 1, "--dump", mine), "the directory is not empty and holds no k3c dump")
    d = shutil.copytree(tiny_dump[1], tmp_path / "d")
    refused(k3c("run", "--graph", d / "graph.json", "--dump", d), "holds the --graph file")
    assert f.read_text() == "root:x:0:0\n" and (mine / "notes.txt").exists() and (d / "summary.json").exists()
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        refused(k3c("run", "--tp", 1, "--dump", ro / "dump"), f"{ro} is not writable")


def test_redump_clears_the_earlier_dump_and_keeps_other_files(tiny_dump, tmp_path):
    d = tp2_dump(tiny_dump, tmp_path / "dump")
    (d / "notes.txt").write_text("mine")
    ok(k3c("run", "--model", "layer-kda", "--tp", 1, "--dump", d))
    assert not (d / "rank0").exists() and not (d / "rank1").exists()
    assert json.loads((d / "summary.json").read_text())["run"]["model"] == "layer-kda"
    assert sorted(f.name for f in (d / "svg").glob("layer_*.svg")) == ["layer_01.after.svg", "layer_01.before.svg"]
    assert (d / "notes.txt").read_text() == "mine"


def test_help_version_and_bare_k3c():
    for args in ([], ["-h"], ["--help"]):
        out = ok(k3c(*args))
        assert out.startswith("Usage: k3c [OPTIONS] COMMAND") and "bisect" in out and "--version" in out
    for cmd in ("passes", "run", "diff", "explain", "bisect"):
        assert ok(k3c(cmd, "-h")).startswith(f"Usage: k3c {cmd} [OPTIONS]")
    assert ok(k3c("--version")) == f"k3c {k3compile.__version__}\n"


# ------------------------------------------------------------------------------------ structured trace
def test_passes_log_before_and_after_graphs_to_the_structured_trace():
    """What TORCH_TRACE=dir records (tlparse shows artifacts): each pass's graph before and after."""
    import logging

    from torch._logging._internal import trace_log

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    h = Keep()
    trace_log.addHandler(h)
    try:
        ok(k3c("explain", "fuse_oproj_allreduce", "--model", "layer-mla", "--tp", 1))
    finally:
        trace_log.removeHandler(h)
    arts = {}
    for rec in h.records:
        meta = rec.metadata.get("artifact", {}) if hasattr(rec, "metadata") else {}
        if meta.get("name", "").startswith("k3_"):
            arts[meta["name"]] = rec.payload
    for p in ("fold_moe_finalize", "fuse_oproj_allreduce", "overlap_shared_expert"):
        assert "class GraphModule" in arts[f"k3_{p}_before"] and "class GraphModule" in arts[f"k3_{p}_after"]
    assert "torch.ops.k3.oproj_allreduce_residual" in arts["k3_fuse_oproj_allreduce_after"]
    assert "torch.ops.k3.oproj_allreduce_residual" not in arts["k3_fuse_oproj_allreduce_before"]
    # at TP=1 the router and latent GEMMs become one op (no gather)
    assert "torch.ops.k3.router_latent_sharded" in arts["k3_shard_router_latent_after"]


# ------------------------------------------------------------------------------------ TP=2, console script
@pytest.mark.slow
def test_console_script_tp2_with_torch_trace(tmp_path):
    exe = shutil.which("k3c", path=os.path.dirname(sys.executable))
    assert exe, "the k3c console script is not installed next to this python (pip install -e .)"
    env = dict(os.environ, TORCH_TRACE=str(tmp_path / "trace"))
    p = subprocess.run([exe, "run", "--dump", tmp_path / "dump"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "TP=2 (2 ranks, gloo)" in out and "ranks agree: True" in out
    n_moe = len(TINY.moe_layers)
    expect = {"shard_router_latent": n_moe, "fuse_router_topk": n_moe, "fold_moe_finalize": n_moe, "fuse_oproj_allreduce": TINY.num_layers,
              "overlap_shared_expert": n_moe}
    for name, n in expect.items():
        cells = row(out, name)
        assert cells[2] == f"{n}/{n}" and cells[-2:] == ["0", "0"], cells
    logs = sorted((tmp_path / "trace").glob("*rank_*"))
    assert len(logs) == 2
    for log in logs:
        text = log.read_text()
        for name in expect:
            assert f'"name": "k3_{name}_before"' in text and f'"name": "k3_{name}_after"' in text, log.name
    # each rank dumped its own graph; rank 1's reloads (matched as rank 1 of TP=2) to the same report
    s1 = json.loads((tmp_path / "dump" / "rank1" / "summary.json").read_text())
    assert s1["run"]["rank"] == 1 and s1["run"]["tp"] == 2
    # (the dump's folder as --graph: its graph.json)
    out = ok(k3c("run", "--graph", tmp_path / "dump" / "rank1", "--dump", tmp_path / "again"))
    again = json.loads((tmp_path / "again" / "summary.json").read_text())["report"]
    assert match_report(again) == match_report(s1["report"])
    assert "numerics not checked: the graph is TP=2" in out


@pytest.mark.slow
def test_inductor_mode_runs_the_passes_in_inductor():
    out = ok(k3c("explain", "fuse_oproj_allreduce", "--model", "layer-kda", "--tp", 1, "--inductor",
                 "--dtype", "float32"))
    assert "1/1 sites" in out and "no near-misses" in out


# ------------------------------------------------------------------------------------------------ k3c bench
@pytest.mark.parametrize("args, code, line", [
    (["--layers", "2xyz"], 2, "--layers: '2xyz' is not a layer kind"),
    (["--layers", ","], 2, "--layers: no layer given"),
    (["--ms", "1,a"], 2, "--ms: '1,a' is not a list of integers"),
    (["--ms", "0"], 2, "--ms: batch sizes must be >= 1"),
    (["--tp", "0"], 2, "--tp must be >= 1"),
    (["--tp", "5"], 1, None),   # no GPU here; on a GPU: heads do not split over 5
])
def test_bench_refuses_bad_input_in_one_line(args, code, line):
    r = k3c("bench", *args)
    assert r.exit_code == code, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3c: error: "), r.output
    if line is not None:
        assert line in lines[0], r.output
    assert "Traceback" not in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_bench_without_gpu_is_one_line():
    r = k3c("bench")
    assert r.exit_code == 1 and r.output.strip() == (
        "k3c: error: k3c bench needs a CUDA GPU and none is visible (torch.cuda.is_available() is False)"), r.output


def test_bench_layer_choice_and_widths():
    from k3compile.cli import bench as B
    assert B.parse_layers("3kda,1mla") == ["kda"] * 3 + ["mla"] == B.parse_layers("kda, kda,kda,MLA")
    cfg = B.config(8, 1024)
    ids = B.layer_ids(cfg, B.parse_layers("3kda,1mla"))
    assert ids == sorted(set(ids)) and all(not cfg.is_dense(i) for i in ids)
    assert [cfg.is_mla(i) for i in ids] == [False, False, False, True]
    assert (cfg.kda_heads, cfg.expert_inter) == (96 // 8, 3072 // 8)
    with pytest.raises(B.BenchError, match="does not split"):
        B.config(5, 1024)
