"""The `k3c` commands (typer + rich). The work itself is in `engine.py`; this file parses,
checks arguments (one clear line and a non-zero exit code for each bad one), launches ranks and
renders results. Exit codes: 0 ok; 1 a failure (unreadable file, no GPU, a rank failed, bisect
found a pass past tolerance, `run --strict` with missed sites); 2 a bad argument."""
from __future__ import annotations

import difflib
import math
import os
import pathlib
import sys
import time
from typing import Annotated, Literal, Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..config import env, knob

app = typer.Typer(
    name="k3c", add_completion=False, rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]},
    help="k3c: pass-by-pass debugging of the k3 torch.compile backend (Kimi K3 decoder). "
         "Which passes fire, where the others stopped and why, and what each one does to the numerics.")

ModelName = Literal["tiny", "small", "layer-kda", "layer-mla"]
DEFAULT_TP = 2

# options shared by run, bisect and explain
OptModel = Annotated[Optional[ModelName], typer.Option(
    "--model", "-m", help="the tiny K3 (default), the small one, or one decoder layer of tiny: layer-kda, layer-mla",
    show_default=False)]
OptTP = Annotated[Optional[int], typer.Option(
    "--tp", help=f"tensor-parallel size; launches that many ranks (gloo on CPU, NCCL on GPU). Default {DEFAULT_TP}; "
                 "with --graph: the graph's own", show_default=False)]
OptBatch = Annotated[int, typer.Option("--batch", "-b", help="sequences per decode step (M)")]
OptPasses = Annotated[Optional[str], typer.Option("--passes", metavar="A,B", help="only these passes",
                                                  show_default=False)]
OptSkip = Annotated[Optional[str], typer.Option("--skip", metavar="A,B", help="skip these passes",
                                                show_default=False)]
OptDevice = Annotated[Literal["cpu", "cuda"], typer.Option("--device", help="cpu | cuda")]
OptDtype = Annotated[Literal["bfloat16", "float32"], typer.Option(
    "--dtype", help="model dtype; float32 also enables the fused ops for it (they default to bf16 only)")]
OptInductor = Annotated[bool, typer.Option(
    "--inductor", help="compile every pass prefix with Inductor codegen instead of the eager rewrite mode (slow)")]
OptGraph = Annotated[Optional[str], typer.Option(
    "--graph", metavar="FILE", help="run the passes on a graph file instead of a model: .json (from --dump), .pt2 (torch.export), "
                    ".py (readable graph; needs --trust-code)", show_default=False)]
OptTrust = Annotated[bool, typer.Option(
    "--trust-code", help="allow loading a .py graph, which executes the file")]
OptSym = Annotated[Optional[list[str]], typer.Option(
    "--sym", metavar="NAME=N", help="NAME=N: the value of a symbolic size in a .py graph (repeatable; default 8)", show_default=False)]
OptRank = Annotated[Optional[int], typer.Option(
    "--rank", help="with --graph at TP > 1: which rank the graph is matched as (default: the saved one, or 0)",
    show_default=False)]


def _out() -> Console:
    # a pipe or a file gets 100 columns, so the tables keep their shape in logs and READMEs
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 100)


def fail(msg: str, code: int = 1):
    Console(stderr=True, highlight=False, soft_wrap=True).print(Text("k3c: error: ", style="bold red") + Text(msg))
    raise typer.Exit(code)


def _at_least(value: int | None, option: str, lo: int) -> None:
    if value is not None and value < lo:
        fail(f"{option} must be >= {lo}, got {value}", 2)


def _check_tol(tol: float) -> None:
    if not math.isfinite(tol) or tol < 0:
        fail(f"--tol must be a finite number >= 0, got {tol:g}", 2)


def _dump_target(dump: str | None, graph: str | None = None) -> None:
    """Check the --dump directory before anything runs, and clear an earlier k3c dump in it."""
    if dump is None:
        return
    from .engine import clear_dump, is_dump
    if not dump.strip():
        fail("--dump needs a directory name, got an empty one", 2)
    d = pathlib.Path(dump)
    if graph is not None and d.resolve() in (g := pathlib.Path(graph).resolve(), *g.parents):
        fail(f"--dump {dump} holds the --graph file, which the dump would overwrite: dump into another directory", 2)
    here = next(p for p in (d, *d.absolute().parents) if p.exists())  # d, or the folder it would be made in
    if not here.is_dir():
        fail(f"--dump {dump}: {here} is a file, not a directory", 2)
    if not os.access(here, os.W_OK | os.X_OK):
        fail(f"--dump {dump}: {here} is not writable", 2)
    if d.is_dir() and any(d.iterdir()):
        if not is_dump(d):
            fail(f"--dump {dump}: the directory is not empty and holds no k3c dump; give a new or empty one", 2)
        try:
            clear_dump(d)
        except OSError as e:
            fail(f"--dump {dump}: cannot clear the earlier dump: {e}")


def _read_dump(dump_dir: str, rank: int | None) -> tuple[pathlib.Path, dict]:
    from .engine import RankError, read_summary
    try:
        return read_summary(dump_dir, rank)
    except RankError as e:
        fail(str(e), 2)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))


def _names(text: str | None, what: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    from ..options import PASS_ORDER
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in names if p not in PASS_ORDER]
    if bad:
        fail(f"unknown pass{'es' if len(bad) > 1 else ''} {', '.join(bad)} in {what}; valid passes: "
             f"{', '.join(PASS_ORDER)}", 2)
    return names


def _check_pass(name: str) -> str:
    from ..options import PASS_ORDER
    if name not in PASS_ORDER:
        fail(f"unknown pass {name!r}; valid passes: {', '.join(PASS_ORDER)}", 2)
    return name


def _spec(model, tp, batch, passes, skip, device, dtype, inductor, graph, **kw):
    from .engine import RunSpec, build_config
    if graph is not None and model is not None:
        fail("--graph and --model exclude each other: a graph file brings its own model", 2)
    if graph is not None and inductor:
        fail("--inductor has no effect with --graph: the passes run on the loaded graph itself", 2)
    _at_least(batch, "--batch", 1)
    _at_least(tp, "--tp", 1)
    spec = RunSpec(model=model or "tiny", tp=tp if tp is not None else DEFAULT_TP, batch=batch,
                   passes=_names(passes, "--passes"), skip=_names(skip, "--skip") or (), device=device,
                   dtype=dtype, inductor=inductor, progress=sys.stderr.isatty(), **kw)
    if graph is None:
        try:
            build_config(spec).check_tp(spec.tp)
        except ValueError as e:
            fail(f"bad TP size: {e}", 2)
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            fail("--device cuda: no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False); "
                 "use --device cpu")
        if graph is None and torch.cuda.device_count() < spec.tp:
            fail(f"--tp {spec.tp} --device cuda needs {spec.tp} GPUs; {torch.cuda.device_count()} visible")
    return spec


def _execute(spec, graph=None, trust_code=False, sym=None, rank=None, tp_given=None) -> list[dict]:
    """Run (rank results, rank 0 first); any failure is one line and exit code 1."""
    from .engine import RankError, run_graph, run_model
    from .graphfile import GraphFileError
    try:
        if graph is not None:
            return [run_graph(spec, graph, trust_code=trust_code, sym=_sym(sym), tp=tp_given, rank=rank)]
        if spec.tp == 1:
            return [run_model(0, 1, spec)]
        from ..distributed import run_ranks
        return run_ranks(run_model, spec.tp, spec, backend="nccl" if spec.device == "cuda" else "gloo")
    except typer.Exit:
        raise
    except RankError as e:
        fail(str(e), 2)
    except GraphFileError as e:
        fail(str(e))
    except Exception as e:  # noqa: BLE001 - one line for the user; the cli_debug knob for the traceback
        if knob("cli_debug") not in ("", "0"):
            raise
        fail(_one_line(e) + "  (K3_KNOBS=cli_debug=1 shows the traceback)")


def _one_line(e: Exception) -> str:
    text = str(e).strip()
    if isinstance(e, RuntimeError) and text.startswith("a rank failed:"):
        # "a rank failed:\nrank 0: Type: msg\nTraceback ..." -> "rank 0 failed: Type: msg"
        first = text.splitlines()[1] if len(text.splitlines()) > 1 else text
        return first.replace(": ", " failed: ", 1)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _sym(items: list[str] | None) -> dict[str, int]:
    out = {}
    for it in items or []:
        name, _, val = it.partition("=")
        if not name or not val.strip().lstrip("-").isdigit():
            fail(f"--sym takes NAME=N (an integer), got {it!r}", 2)
        out[name.strip()] = int(val)
    return out


# ------------------------------------------------------------------------------------ rendering
def _fmt_err(x) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.2e}"


def _sites(p) -> Text:
    if p.error:
        return Text("ERROR", style="bold red")
    if p.skipped:
        return Text("disabled" if p.skipped == "disabled by options" else "skipped", style="yellow")
    style = "green" if p.matched == p.expected else "bold red"
    return Text(f"{p.matched}/{p.expected}", style=style)


def _merge_stages(results: list[dict]) -> list[dict]:
    """Per stage, the worst error over ranks."""
    stages = [dict(s) for s in results[0]["stages"]]
    for r in results[1:]:
        for s, o in zip(stages, r["stages"]):
            for k in ("abs", "rel"):
                if o.get(k) is not None and s.get(k) is not None:
                    s[k] = max(s[k], o[k])
    return stages


def render_run(con: Console, results: list[dict], tol: float, wall: float, spec) -> None:
    from ..report import CompileReport
    r0 = results[0]
    rep = CompileReport.from_dict(r0["report"])
    st = rep.structure
    world = r0["world"]
    if r0["source"] == "model":
        con.print(Text("k3c run: ", style="bold") + Text(r0["title"]))
        mode = "Inductor codegen" if spec.inductor else "eager rewrite mode (no codegen)"
        comm = "" if world == 1 else f" ({world} ranks, {'NCCL' if spec.device == 'cuda' else 'gloo'})"
        con.print(f"TP={world}{comm}, batch M={spec.batch}, {spec.dtype}, {spec.device}, {mode}")
    else:
        con.print(Text("k3c run --graph: ", style="bold") + Text(r0["title"]))
    if not rep.is_k3:
        con.print(rep.render())
    else:
        tr = r0["timings"].get("trace")
        canon = next((p.nodes_before for p in rep.passes if _ran(p)), r0["nodes"])
        con.print(f"graph: {r0['nodes']} nodes before the passes"
                  + (f" ({canon} after canonicalize)" if canon != r0["nodes"] else "")
                  + (f", traced in {tr:.1f} s" if tr else "")
                  + f"; {_n(st.get('attention_layers'), 'attention layer')}, {_n(st.get('moe_layers'), 'MoE layer')}, "
                    f"TP={st.get('tp')}, M={st.get('m')}, {st.get('dtype')}")
    stages = _merge_stages(results) if r0["stages"] else []
    by_pass = {s["after"]: s for s in stages}
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    t.add_column("#", justify="right")
    t.add_column("pass", no_wrap=True)
    t.add_column("sites", justify="right")
    t.add_column("nodes", justify="right")
    t.add_column("time", justify="right")
    t.add_column("max abs err", justify="right")
    t.add_column("max rel err", justify="right")
    if stages:
        s0 = by_pass.get(None, {})
        t.add_row("0", Text("(no K3 pass)", style="dim"), "", str(r0["nodes"]), "", _err_text(s0.get("abs"), None),
                  _err_text(s0.get("rel"), tol, s0.get("rel")))
    for i, p in enumerate(rep.passes, 1):
        s = by_pass.get(p.name, {})
        nodes = f"{p.nodes_before} → {p.nodes_after}" if (p.nodes_before or p.nodes_after) else ""
        dim = not _ran(p)  # the graph is the previous row's: same numbers, greyed
        t.add_row(str(i), p.name, _sites(p), nodes, f"{p.seconds * 1e3:.0f} ms" if _ran(p) else "",
                  _err_text(s.get("abs"), None, dim=dim), _err_text(s.get("rel"), tol, s.get("rel"), dim=dim))
    con.print(t)
    if stages:
        ranks = f"; worst of {world} ranks" if world > 1 else ""
        ref = "the uncompiled model's logits" if r0["source"] == "model" else "the graph run without passes"
        con.print(Text(f"errors: one decode step vs {ref}, with the pass and every earlier one on{ranks}; "
                       f"rel = max|diff| / max|ref|", style="dim"))
    for p in rep.passes:
        if p.skipped and p.skipped != "disabled by options":
            con.print(Text(f"{p.name} skipped: {p.skipped}", style="yellow"))
        if p.error:
            con.print(Text(f"{p.name} failed and was rolled back: {p.error}", style="red"))
        if p.near_misses:
            con.print(Text(f"{p.name}: {len(p.near_misses)} near-miss{'es' if len(p.near_misses) > 1 else ''}, "
                           f"first at {p.near_misses[0].site}: {p.near_misses[0].reason}", style="red")
                      + Text(f"  (k3c explain {p.name})", style="dim"))
        for note in p.notes:
            con.print(f"{p.name}: {note}")
    for r in results:
        for note in r["notes"]:
            con.print(Text(("" if world == 1 else f"rank {r['rank']}: ") + note, style="yellow"))
    if r0["source"] == "model" and stages and stages[-1].get("tokens") is not None:
        toks = stages[-1]["tokens"]
        same = toks == r0["ref_tokens"]
        agree = all(r["stages"][-1].get("tokens") == toks for r in results)
        con.print(f"next tokens (all passes on): {toks}" + (" = eager's" if same else
                                                              f" (eager: {r0['ref_tokens']})")
                  + ("" if world == 1 else f"; ranks agree: {agree}"))
    worst = max((s.get("rel") or 0.0) for s in stages) if stages else None
    if worst is not None and worst > tol:
        con.print(Text(f"error past --tol {tol:g}: `k3c bisect` names the pass", style="bold red"))
    for r in results:
        if r.get("dump"):
            con.print(f"dump: {r['dump']} (k3c diff {r['dump']} PASS; svg/index.html)")
    tm = r0["timings"]
    mgr = f"pass manager {tm['passes'] * 1e3:.0f} ms"
    con.print(f"done in {wall:.1f} s" + (f" (rank 0: trace {tm['trace']:.1f} s, {mgr})" if "trace" in tm else f" ({mgr})"))


def _rel(source: str) -> str:
    """`/abs/path/file.py:12: code` -> `path/file.py:12: code` when the file is under the current directory."""
    cwd = os.getcwd() + os.sep
    return source[len(cwd):] if source.startswith(cwd) else source


def _n(k: int, what: str) -> str:
    return f"{k} {what}{'' if k == 1 else 's'}"


def _ran(p) -> bool:
    return p.skipped is None and p.error is None


def _err_text(x, tol, rel=None, dim=False) -> Text:
    s = _fmt_err(x)
    if tol is not None and rel is not None and rel > tol:
        return Text(s, style="bold red")
    return Text(s, style="dim" if dim else "")


# ------------------------------------------------------------------------------------ commands
def _version(value: bool) -> None:
    if value:
        from .. import __version__
        typer.echo(f"k3c {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _main(ctx: typer.Context, version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="print the version and exit")] = False):
    if ctx.invoked_subcommand is None:  # bare `k3c`: the help, exit code 0
        typer.echo(ctx.get_help())
        raise typer.Exit()


@app.command()
def passes(
    passes_: OptPasses = None, skip: OptSkip = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="also print each pass's full docstring")] = False,
):
    """Each pass and its pattern: what it matches and emits, enabled or not, its batch (M) range."""
    import inspect

    from ..options import K3Options
    from ..passes.manager import PASSES
    kw = {}
    if passes_ is not None:
        kw["passes"] = _names(passes_, "--passes")
    if skip is not None:
        kw["skip"] = _names(skip, "--skip")
    opts = K3Options.make(**kw)
    con = _out()
    t = Table(box=box.SIMPLE_HEAD, show_lines=True, title="K3 passes, in the order they run")
    t.add_column("#", justify="right")
    t.add_column("pass / what it does")
    t.add_column("pattern → emits")
    t.add_column("on", justify="center")
    t.add_column("batch M")
    for i, (name, p) in enumerate(PASSES.items(), 1):
        on = name in opts.passes
        lo, hi = opts.m_ranges.get(name, (1, 1 << 30))
        rng = f"{lo}..{'any' if hi >= 1 << 30 else hi}"
        t.add_row(str(i), Text(name, style="bold") + Text("\n" + p.description, style="dim"),
                  Text(p.pattern) + Text("\n→ " + p.emits, style="cyan"),
                  Text("yes", style="green") if on else Text("no", style="red"), rng)
    con.print(t)
    con.print(f"Every pass applies to dtypes {', '.join(opts.dtypes)} and TP sizes {list(opts.tp_sizes)}; outside "
              f"them, or outside its batch range at a static M, a pass is skipped and the report says why.")
    con.print("Before the passes, canonicalize rewrites other spellings of the same math into the forms the "
              "patterns know (always on).")
    src = [f"K3_PASSES={env('K3_PASSES')}"] if env("K3_PASSES") else []
    src += [f"K3_SKIP={env('K3_SKIP')}"] if env("K3_SKIP") else []
    if src and not kw:
        con.print(Text(f"enabled set from the environment: {' '.join(src)}", style="yellow"))
    if verbose:
        for name, p in PASSES.items():
            con.print(Text(f"\n{name}", style="bold"))
            con.print(inspect.getdoc(sys.modules[type(p).__module__]) or "")


@app.command()
def run(
    model: OptModel = None, tp: OptTP = None, batch: OptBatch = 2, passes_: OptPasses = None, skip: OptSkip = None,
    dump: Annotated[Optional[str], typer.Option(
        "--dump", metavar="DIR", help="write per pass NN_<pass>.before.py/.after.py, graph.json (reload with --graph), "
                       "summary.json and svg/ (each layer before/after) into this directory",
        show_default=False)] = None,
    device: OptDevice = "cpu", dtype: OptDtype = "bfloat16", inductor: OptInductor = False,
    graph: OptGraph = None, trust_code: OptTrust = False, sym: OptSym = None, rank: OptRank = None,
    tol: Annotated[float, typer.Option("--tol", help="relative error that counts as wrong (colours the table)")
                   ] = 1e-2,
    strict: Annotated[bool, typer.Option("--strict", help="exit 1 if an expected site did not match or a pass "
                                                          "failed")] = False,
):
    """Compile and run one decode step; per pass: sites matched/expected, nodes before/after,
    pass time, and the max abs/rel error of the logits vs eager with that pass and every earlier one on."""
    _check_tol(tol)
    _at_least(rank, "--rank", 0)
    spec = _spec(model, tp, batch, passes_, skip, device, dtype, inductor, graph, dump=dump)
    _dump_target(dump, graph)
    t = time.perf_counter()
    results = _execute(spec, graph, trust_code, sym, rank, tp)
    con = _out()
    render_run(con, results, tol, time.perf_counter() - t, spec)
    from ..report import CompileReport
    if strict and not all(CompileReport.from_dict(r["report"]).ok for r in results):
        fail("--strict: an expected site did not match or a pass failed (see above)")


@app.command()
def diff(
    dump_dir: Annotated[str, typer.Argument(metavar="DIR", help="a directory written by `k3c run --dump`")],
    pass_name: Annotated[str, typer.Argument(metavar="PASS", help="the pass whose before/after to diff")],
    context: Annotated[int, typer.Option("--context", "-U", help="lines of context")] = 3,
    comments: Annotated[bool, typer.Option("--comments", help="keep the `# File: ...` source comments")] = False,
    rank: Annotated[Optional[int], typer.Option("--rank", help="which rank of a TP > 1 dump (default 0)",
                                                show_default=False)] = None,
):
    """The before/after diff of one pass, coloured."""
    from ..report import CompileReport
    _check_pass(pass_name)
    _at_least(context, "--context", 0)
    _at_least(rank, "--rank", 0)
    d, summary = _read_dump(dump_dir, rank)
    rep = CompileReport.from_dict(summary["report"])
    files = summary.get("files", {}).get("passes", {}).get(pass_name)
    p = rep.get(pass_name)
    if not files:
        why = p.skipped or (f"failed: {p.error}" if p.error else "it did not run")
        fail(f"{pass_name} did not change the graph in this dump ({why}): nothing to diff")
    try:
        before = (d / files["before"]).read_text().splitlines()
        after = (d / files["after"]).read_text().splitlines()
    except OSError as e:
        fail(f"cannot read the dumped graphs: {e}")
    if not comments:
        keep = lambda ls: [ln for ln in ls if ln.strip() and not ln.lstrip().startswith("#")]  # noqa: E731
        before, after = keep(before), keep(after)
    lines = list(difflib.unified_diff(before, after, files["before"], files["after"], n=context, lineterm=""))
    con = _out()
    added = sum(1 for ln in lines if ln.startswith("+") and not ln.startswith("+++"))
    removed = sum(1 for ln in lines if ln.startswith("-") and not ln.startswith("---"))
    import re
    new_ops: dict[str, int] = {}
    for ln in lines:
        if ln.startswith("+") and not ln.startswith("+++"):
            for m in re.findall(r"torch\.ops\.(k3\.\w+)", ln):
                new_ops[m] = new_ops.get(m, 0) + 1
    con.print(Text(f"{pass_name}: ", style="bold") + Text(
        f"{p.status()}; nodes {p.nodes_before} → {p.nodes_after}; {removed} lines removed, {added} added"
        + ("; new: " + ", ".join(f"{k.replace('.', '::', 1)} ×{v}" for k, v in new_ops.items()) if new_ops else "")))
    if not lines:
        con.print("(no textual difference)")
    for ln in lines:
        style = ("bold" if ln.startswith(("---", "+++")) else "green" if ln.startswith("+") else
                 "red" if ln.startswith("-") else "cyan" if ln.startswith("@@") else "")
        con.print(Text(ln, style=style), overflow="ignore", crop=False)


@app.command()
def explain(
    pass_name: Annotated[str, typer.Argument(metavar="PASS", help="the pass to explain")],
    dump_dir: Annotated[Optional[str], typer.Argument(
        metavar="[DIR]", help="read the report of a `k3c run --dump` directory instead of compiling",
        show_default=False)] = None,
    model: OptModel = None, tp: OptTP = None, batch: OptBatch = 2, passes_: OptPasses = None, skip: OptSkip = None,
    device: OptDevice = "cpu", dtype: OptDtype = "bfloat16", inductor: OptInductor = False, graph: OptGraph = None,
    trust_code: OptTrust = False, sym: OptSym = None, rank: OptRank = None,
):
    """Every near-miss of one pass: the node where matching stopped, why, and the source line."""
    from ..passes.manager import PASSES
    from ..report import CompileReport
    _check_pass(pass_name)
    _at_least(rank, "--rank", 0)
    if dump_dir is not None:
        _, summary = _read_dump(dump_dir, rank)
        reps = [CompileReport.from_dict(summary["report"])]
        where = f"the dump in {dump_dir}"
    else:
        spec = _spec(model, tp, batch, passes_, skip, device, dtype, inductor, graph, numerics=False)
        results = _execute(spec, graph, trust_code, sym, rank, tp)
        reps = [CompileReport.from_dict(r["report"]) for r in results]
        where = graph or f"the {spec.model} model, TP={results[0]['world']}, M={spec.batch}"
    p = reps[0].get(pass_name)
    pp = PASSES[pass_name]
    con = _out()
    con.print(Text(pass_name, style="bold") + Text(f": {pp.description}"))
    con.print(Text(f"pattern: {pp.pattern}", style="dim"))
    con.print(f"on {where}: " + p.status())
    if p.skipped or p.error:
        return
    if not p.near_misses:
        if p.matched == p.expected:
            con.print(Text(f"no near-misses: all {_n(p.expected, 'expected site')} matched", style="green"))
        else:
            con.print(Text(f"{p.expected - p.matched} expected sites are missing without a near-miss: their anchor "
                           f"op was not found", style="red"))
    for i, nm in enumerate(p.near_misses, 1):
        con.print(Text(f"\n{i}. ", style="bold") + Text(f"site {nm.site}" + (f" in {nm.module}" if nm.module else "")
                                                         + ": matching stopped at ")
                  + Text(nm.stopped_at, style="bold red"))
        if nm.node:
            con.print(Text("   node:   ", style="dim") + Text(nm.node))
        con.print(Text("   why:    ", style="dim") + Text(nm.reason))
        if nm.source:
            con.print(Text("   source: ", style="dim") + Text(_rel(nm.source)))
    if len(reps) > 1:
        others = [r.get(pass_name) for r in reps[1:]]
        if any(len(o.near_misses) != len(p.near_misses) or o.matched != p.matched for o in others):
            con.print(Text("other ranks differ: " + "; ".join(f"rank {i}: {o.status()}" for i, o in
                                                             enumerate(others, 1)), style="yellow"))


@app.command()
def bisect(
    model: OptModel = None, tp: OptTP = None, batch: OptBatch = 2, passes_: OptPasses = None, skip: OptSkip = None,
    device: OptDevice = "cpu", dtype: OptDtype = "bfloat16", inductor: OptInductor = False,
    graph: OptGraph = None, trust_code: OptTrust = False, sym: OptSym = None, rank: OptRank = None,
    tol: Annotated[float, typer.Option("--tol", help="relative error (max|diff| / max|ref|) past which a pass "
                                                     "is wrong")] = 1e-2,
):
    """Turn the passes on one at a time (1, then 1-2, ...) and name the first that pushes the error
    past --tol. Exit code 1 when one does."""
    _check_tol(tol)
    _at_least(rank, "--rank", 0)
    spec = _spec(model, tp, batch, passes_, skip, device, dtype, inductor, graph, tol=tol)
    t = time.perf_counter()
    results = _execute(spec, graph, trust_code, sym, rank, tp)
    from ..report import CompileReport
    r0 = results[0]
    rep = CompileReport.from_dict(r0["report"])
    con = _out()
    if not r0["stages"]:
        fail("no numerics to bisect: " + ("; ".join(r0["notes"]) or "the graph has no saved inputs"))
    stages = _merge_stages(results)
    con.print(Text("k3c bisect: ", style="bold") + Text(r0["title"]) + Text(
        f" (TP={r0['world']}, tol {tol:g})"))
    t_ = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for c in ("#", "turned on", "sites", "max rel err", ""):
        t_.add_column(c, justify="right" if c in ("#", "max rel err") else "left", no_wrap=c == "turned on")
    culprit = None
    for i, s in enumerate(stages):
        p = rep.get(s["after"]) if s["after"] else None
        bad = s.get("rel") is not None and s["rel"] > tol
        if bad and culprit is None:
            culprit = s["after"] or "(no K3 pass)"
        verdict = (Text("past tol", style="bold red") if bad else Text("ok", style="green"))
        if p is not None and not _ran(p):
            verdict = Text(("disabled" if p.skipped == "disabled by options" else "skipped") + ": graph unchanged",
                           style="yellow")
        t_.add_row(str(i), "(no K3 pass)" if p is None else f"+ {p.name}", _sites(p) if p else "",
                   _err_text(s.get("rel"), tol, s.get("rel")), verdict)
    con.print(t_)
    what = "logits" if r0["source"] == "model" else "graph outputs"
    con.print(Text(f"each row: that pass and every earlier one on; rel err = max|diff| / max|ref| of the {what}"
                   + (f", worst of {r0['world']} ranks" if r0["world"] > 1 else ""), style="dim"))
    wall = time.perf_counter() - t
    if culprit is None:
        con.print(Text(f"every prefix is within tol {tol:g}: no pass changes the numerics past it", style="green")
                  + Text(f"  ({wall:.1f} s)", style="dim"))
        return
    if culprit == "(no K3 pass)":
        con.print(Text(f"the error is past tol {tol:g} with no K3 pass on ({_fmt_err(stages[0]['rel'])}): "
                       f"not caused by a K3 pass (the compiler itself differs; try --dtype float32 or a larger --tol)",
                       style="bold red"))
        raise typer.Exit(1)
    k = next(i for i, s in enumerate(stages) if s["after"] == culprit)
    prev = stages[k - 1].get("rel")
    con.print(Text("first pass past tolerance: ", style="bold red") + Text(culprit, style="bold") + Text(
        f" (max rel err {_fmt_err(stages[k]['rel'])} > {tol:g}; {_fmt_err(prev)} before it)"))
    alone = [r.get("alone") for r in results if r.get("alone")]
    if alone:
        worst = max(a["rel"] for a in alone)
        con.print(f"{culprit} alone (no other pass): max rel err {_fmt_err(worst)}"
                  + (" - wrong by itself" if worst > tol else " - within tol alone: it interacts with an earlier pass"))
    con.print(Text(f"what it changed: k3c run --dump DIR, then k3c diff DIR {culprit}  ({wall:.1f} s)", style="dim"))
    raise typer.Exit(1)


def main() -> None:  # `python -m k3compile.cli`
    app(prog_name="k3c")


@app.command()
def bench(
    layers: Annotated[str, typer.Option("--layers", "-l", metavar="KINDS",
                                        help="the layers of the step, in order: kda,kda,kda,mla or 3kda,1mla")] = "3kda,1mla",
    tp: Annotated[int, typer.Option("--tp", help="per-rank widths of this TP size (one GPU, no communication)")] = 8,
    ms: Annotated[str, typer.Option("--ms", metavar="M,M", help="batch sizes (sequences per decode step)")] = "1,16,64",
    ctx: Annotated[int, typer.Option("--ctx", help="MLA: cached tokens attended to")] = 1024,
    rounds: Annotated[int, typer.Option("--rounds", help="timing rounds per mode (median reported)")] = 3,
    out: Annotated[Optional[str], typer.Option("--out", "-o", metavar="FILE", help="also write the result as JSON",
                                               show_default=False)] = None,
):
    """Time decode steps of real-width K3 layers on one GPU: eager, Inductor and k3 under CUDA graphs;
    us per step and per layer, speedup over the faster baseline, kernels per step, and k3's time over
    the bytes floor (the bytes the step must read at the measured bandwidth, experts as routed)."""
    from . import bench as B
    _at_least(tp, "--tp", 1)
    _at_least(ctx, "--ctx", 1)
    _at_least(rounds, "--rounds", 1)
    try:
        kinds = B.parse_layers(layers)
        batch = [int(m) for m in ms.split(",") if m.strip()]
    except ValueError:
        fail(f"--ms: {ms!r} is not a list of integers (e.g. 1,16,64)", 2)
    except B.BenchError as e:
        fail(str(e), 2)
    if not batch or min(batch) < 1:
        fail("--ms: batch sizes must be >= 1", 2)
    if out is not None and (pathlib.Path(out).is_dir() or not pathlib.Path(out).resolve().parent.is_dir()):
        fail(f"--out: {out} is a folder or its folder does not exist", 2)
    con = _out()
    try:
        res = B.run(kinds, tp, batch, ctx=ctx, rounds=rounds, progress=lambda s: con.print(Text(s, style="dim")))
    except B.BenchError as e:
        fail(str(e))
    t = Table(box=box.SIMPLE_HEAD, title=f"{len(kinds)} layers ({','.join(kinds)}), TP={tp} widths, {res['gpu']}, "
                                         f"torch {res['torch']}; us per decode step (CUDA graph, launch hidden)")
    for c in ("M", "eager", "inductor", "k3", "k3 / layer", "speedup", "kernels e / i / k3", "k3 / floor", "experts"):
        t.add_column(c, justify="right")
    for r in res["rows"]:
        us, k = r["us"], r["kernels"]
        t.add_row(str(r["M"]), f"{us['eager']:.1f}", f"{us['inductor']:.1f}", Text(f"{us['k3']:.1f}", style="bold"),
                  f"{r['us_per_layer']['k3']:.1f}", Text(f"{r['speedup']:.2f}x", style="green" if r["speedup"] >= 1 else "red"),
                  f"{k['eager']} / {k['inductor']} / {k['k3']}", f"{r['k3_vs_floor']:.2f}x ({r['floor_us']:.0f} us)",
                  "+".join(map(str, r["distinct_experts"])))
    con.print(t)
    con.print(f"speedup: the faster of eager and Inductor over k3. floor: bytes the step reads / "
              f"{res['hbm_bytes_per_s'] / 1e12:.2f} TB/s measured; experts: distinct routed experts per MoE layer.")
    for note in dict.fromkeys(n for r in res["rows"] for n in r["kernels_note"]):
        con.print(Text(note, style="dim"))
    errs = max(max(r["rel_err_vs_eager"].values()) for r in res["rows"])
    con.print(f"max rel error of the step's residual vs eager (Inductor, k3): {errs:.3g}")
    if out:
        B.write(out, res, "k3c " + " ".join(sys.argv[1:]))
        con.print(f"wrote {out}")
