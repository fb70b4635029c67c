"""What the k3c commands run (no printing here, except rank 0's progress bar on stderr).

One decode step of a K3 model is traced once (dynamo + AOTAutograd with Inductor's
decompositions, as the k3 backend's eager mode does), the K3 passes run once on a copy of the
graph while a `Recorder` keeps the graph before and after every pass, and then the decode step
runs with the graph after pass k, for every k, and its logits are compared with the uncompiled
model's. The graph after pass k of one run is exactly what a compile with passes 1..k produces
(each pass sees only what the earlier ones left), so this is "compile once per prefix of the
pass list" without tracing more than once. With `inductor=True` every prefix is a real Inductor
compile instead (slow: Inductor's C++ codegen).

`run_model` is a rank function for `k3compile.distributed.run_ranks` (TP > 1: one process per
rank, gloo on CPU, NCCL on GPU); `run_graph` runs the passes on a graph loaded from a file.
Both return plain data (dicts of numbers and strings) that the CLI renders.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import time
import warnings
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule

from ..options import PASS_ORDER, K3Options
from ..passes.manager import PASSES, PassManager, snapshot
from ..report import CompileReport, PassReport, clean_path
from . import graphfile, graphio


@dataclass(frozen=True)
class ModelChoice:
    preset: str
    layers: tuple[int, ...] | None  # build only these layer ids (None: all)
    about: str


MODELS = {
    "tiny": ModelChoice("tiny", None, "the tiny K3 model: 8 layers, every structural feature at small widths"),
    "small": ModelChoice("small", None, "the small K3 model: 12 layers, wider than tiny"),
    "layer-kda": ModelChoice("tiny", (1,), "one decoder layer of the tiny model: KDA attention + LatentMoE"),
    "layer-mla": ModelChoice("tiny", (3,), "one decoder layer of the tiny model: MLA attention + LatentMoE "
                                          "(it also writes an AttnRes block)"),
}


@dataclass(frozen=True)
class RunSpec:
    model: str = "tiny"
    tp: int = 2
    batch: int = 2
    passes: tuple[str, ...] | None = None  # None: every pass (or K3_PASSES)
    skip: tuple[str, ...] = ()
    device: str = "cpu"
    dtype: str = "bfloat16"
    inductor: bool = False
    dump: str | None = None
    numerics: bool = True   # False: only match (explain)
    tol: float | None = None  # bisect: also run the first pass past this error on its own
    progress: bool = False  # rank 0 draws a progress bar on stderr
    prompt_len: int = 4
    seed: int = 0

    def options(self, passes: tuple[str, ...] | None = None) -> K3Options:
        # gate off: this CLI shows what each pass does, also where the per-layer benchmark measured
        # it slower on the GPU (which the backend's default, gate="measured", would skip)
        kw = dict(mode="inductor" if self.inductor else "eager", dtypes=(self.dtype,), skip=self.skip, gate="off")
        if passes is not None:
            kw["passes"] = passes
            kw.pop("skip")
        elif self.passes is not None:
            kw["passes"] = self.passes
        return K3Options.make(**kw)


def build_config(spec: RunSpec):
    from ..model import K3Config
    return K3Config.preset(MODELS[spec.model].preset, dtype=spec.dtype)


def describe_model(spec: RunSpec) -> str:
    cfg = build_config(spec)
    ch = MODELS[spec.model]
    if ch.layers is not None:
        return f"{spec.model}: {ch.about}"
    blocks = [i for i in range(cfg.num_layers) if cfg.writes_block(i)]
    return (f"{spec.model} K3: {cfg.num_layers} layers (KDA {cfg.kda_layers}, MLA {cfg.mla_layers}), dense "
            f"{list(cfg.dense_layers)}, {len(cfg.moe_layers)} LatentMoE layers, AttnRes blocks written at {blocks}")


# ------------------------------------------------------------------------------------ progress
class Progress:
    """A rich progress bar on stderr (transient), or nothing."""

    def __init__(self, enabled: bool, total: int):
        self.p = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress as RP, SpinnerColumn, TextColumn, TimeElapsedColumn
            self.p = RP(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
            self.task = self.p.add_task("k3c", total=total)
            self.p.start()

    @contextlib.contextmanager
    def step(self, text: str):
        if self.p is not None:
            self.p.update(self.task, description=text)
        try:
            yield
        finally:
            if self.p is not None:
                self.p.advance(self.task)

    def close(self):
        if self.p is not None:
            self.p.stop()


# ------------------------------------------------------------------------------------ recording
class Recorder:
    """PassManager observer: copies of the graph as received and before/after every pass that ran."""

    def __init__(self, input_names: list[str] | None = None):
        self.root: torch.nn.Module | None = None
        self.input: Graph | None = None
        self.before: dict[str, Graph] = {}
        self.after: dict[str, Graph] = {}
        self.input_names = input_names  # what each of dynamo's graph inputs is (`layers.3.attn.o_proj`)

    def __call__(self, stage: str, name: str | None, graph: Graph) -> None:
        if stage == "input":
            self.root = graph.owning_module
            if self.input_names:
                label_inputs(graph, self.input_names)
            self.input = snapshot(graph)
        elif stage == "before":
            self.before[name] = snapshot(graph)
        else:
            self.after[name] = snapshot(graph)

    def module(self, graph: Graph) -> GraphModule:
        return GraphModule(self.root, snapshot(graph))

    def readable(self, graph: Graph) -> str:
        return self.module(graph).print_readable(print_output=False)

    def final(self) -> Graph:
        return list(self.after.values())[-1] if self.after else self.input


def input_names(gm: GraphModule) -> list[str]:
    """Dynamo's graph inputs as the model's names: `layers.3.attn.o_proj`, `cache.kv[3]`."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        src = getattr(n.meta.get("grapharg"), "source", None)
        name = getattr(src, "name", None)
        name = name() if callable(name) else name
        out.append(clean_path(name) if isinstance(name, str) else n.name)
    return out


def label_inputs(graph: Graph, names: list[str]) -> None:
    """Name each AOT graph input after the dynamo input it stands for (meta 'k3c_input')."""
    for n in graph.nodes:
        idx = getattr(n.meta.get("desc"), "idx", None) if n.op == "placeholder" else None
        if isinstance(idx, int) and 0 <= idx < len(names):
            n.meta["k3c_input"] = names[idx]


def ran(p: PassReport) -> bool:
    return p.skipped is None and p.error is None


def run_passes(gm: GraphModule, opts: K3Options, name: str, rec: Recorder | None = None
               ) -> tuple[CompileReport, Recorder]:
    """Run the K3 passes once on a copy of `gm`, recording the graphs."""
    rec = rec or Recorder()
    mgr = PassManager(opts, name=name, observer=rec)
    work = GraphModule(gm, snapshot(gm.graph))
    with _quiet():
        mgr(work.graph)
    if mgr.last is None:
        raise RuntimeError("the K3 pass manager failed on this graph (run with K3_STRICT=1 for the traceback)")
    return mgr.last, rec


@contextlib.contextmanager
def _quiet():
    """The CLI shows missed sites and rolled-back passes in its table; drop the passes' warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"k3[ :]")
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")  # our fresh compiles
        yield


class EagerCapture:
    """A torch.compile backend: the k3 backend's eager mode with the passes run once, on a copy.

    AOT-traces the dynamo graph with Inductor's decompositions, runs the PassManager on a copy of
    the result (recording every pass), and then runs whichever recorded graph `select` chose:
    at first the graph before the passes."""

    def __init__(self, opts: K3Options, name: str, keep_inputs: bool):
        self.opts, self.name, self.keep_inputs = opts, name, keep_inputs
        self.report: CompileReport | None = None
        self.rec: Recorder | None = None
        self.inputs: list | None = None
        self.user_outputs: list[int] | None = None
        self.calls = 0
        self.names: list[str] = []
        self._current = None

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table
        self.names = input_names(gm)
        return aot_autograd(fw_compiler=self._fw, decompositions=select_decomp_table())(gm, example_inputs)

    def _fw(self, g: GraphModule, _inputs):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("the decode step compiled a second graph (a guard failed); k3c expects one")
        from torch._guards import TracingContext
        ctx = TracingContext.try_get()
        fm = getattr(ctx, "fw_metadata", None) if ctx is not None else None
        if fm is not None:  # graph outputs: updated inputs (the cache) first, then the model's outputs
            start = fm.num_mutated_inp_runtime_indices
            self.user_outputs = list(range(start, start + len(fm.output_info)))
        self.report, self.rec = run_passes(g, self.opts, self.name, Recorder(self.names))
        self.select(self.rec.input)

        def run(args):
            if self.keep_inputs and self.inputs is None:
                self.inputs = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            return self._current(args)
        run._boxed_call = True
        return run

    def select(self, graph: Graph) -> None:
        from functorch.compile import make_boxed_func
        self._current = make_boxed_func(self.rec.module(graph).forward)


def _err(out, ref) -> tuple[float, float]:
    """(max |out - ref|, that / max |ref|) over floating tensors, the worst of several outputs."""
    outs, refs = (out, ref) if isinstance(out, (list, tuple)) else ([out], [ref])
    worst_abs = worst_rel = 0.0
    for o, r in zip(outs, refs):
        if not (isinstance(o, torch.Tensor) and o.is_floating_point()):
            continue
        d = (o.float() - r.float()).abs().max().item() if o.numel() else 0.0
        worst_abs = max(worst_abs, d)
        worst_rel = max(worst_rel, d / max(r.float().abs().max().item() if r.numel() else 0.0, 1e-30))
    return worst_abs, worst_rel


def _measured(after: str | None, out, ref) -> dict:
    """One prefix's numbers: `after` = the last pass on (None: no pass)."""
    a, r = _err(out, ref)
    d = dict(after=after, abs=a, rel=r, same_as=None)
    if isinstance(out, torch.Tensor) and out.dim() == 2:
        d["tokens"] = out.argmax(-1).tolist()  # the greedy next token per sequence
    return d


def _unchanged(after: str, prev: dict) -> dict:
    """A pass that did not run leaves the previous prefix's graph, so its numbers."""
    return dict(prev, after=after, same_as=prev["after"])


# ------------------------------------------------------------------------------------ model runs
def run_model(rank: int, world: int, spec: RunSpec) -> dict:
    """One rank: build the model, trace one decode step, run the passes, check each prefix."""
    from ..model import K3Model, TPInfo

    t0 = time.perf_counter()
    torch._dynamo.reset()
    opts = spec.options()
    steps = 3 + ((len(PASSES) + (1 if spec.inductor else 0)) if spec.numerics else 0)
    prog = Progress(spec.progress and rank == 0, steps)
    device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
    timings = {}
    try:
        with prog.step(f"building the {spec.model} model (TP={world}, rank {rank})"):
            cfg = build_config(spec)
            model = K3Model(cfg, TPInfo.current(world), device=device, layers=MODELS[spec.model].layers)
        with torch.no_grad(), prog.step("eager reference: prefill a prompt, then one decode step"):
            ids, fresh = decode_inputs(model, spec)
            ref = model(ids, fresh())
        name = f"{spec.model}-tp{world}-rank{rank}"
        if spec.inductor:
            report, rec, stages, extra = _inductor_stages(model, spec, opts, name, ids, fresh, ref, prog, timings)
        else:
            report, rec, stages, extra = _eager_stages(model, spec, opts, name, ids, fresh, ref, prog, timings)
        res = dict(source="model", rank=rank, world=world, title=describe_model(spec), report=report.to_dict(),
                   nodes=len(rec.input.nodes), stages=stages, ref_tokens=ref.argmax(-1).tolist(),
                   timings=timings, notes=extra.pop("notes", []), alone=extra.pop("alone", None), dump=None)
        if spec.dump:
            d = pathlib.Path(spec.dump) / (f"rank{rank}" if world > 1 else "")
            meta = dict(source="model", model=spec.model, batch=spec.batch, tp=world, rank=rank, dtype=spec.dtype,
                        device=spec.device, mode=opts.mode, groups=_groups(rec.input))
            write_dump(d, rec, report, stages, meta, **extra)
            res["dump"] = str(d)
        timings["total"] = time.perf_counter() - t0
        return res
    finally:
        prog.close()


def decode_inputs(model, spec: RunSpec):
    """(token ids [M, 1], fresh()): the greedy next token after a seeded random prompt, and a
    function returning a new copy of the cache as the prompt left it (each run writes its cache)."""
    g = torch.Generator().manual_seed(spec.seed)
    device = model.embed.device
    prompt = torch.randint(0, model.cfg.vocab, (spec.batch, spec.prompt_len), generator=g).to(device)
    with torch.no_grad():
        base = model.new_cache(spec.batch)
        ids = model.prefill(prompt, base).argmax(-1)[:, None]

    def fresh():
        c = model.new_cache(spec.batch)
        for dst, src in zip(c.tensors(), base.tensors()):
            dst.copy_(src)
        return c
    return ids, fresh


def _groups(graph: Graph) -> dict:
    from ..patterns.structure import resolve_group
    out = {}
    for name in graphfile.collective_groups(graph):
        try:
            out[name] = list(resolve_group(name))
        except Exception:  # noqa: BLE001 - not resolvable here
            pass
    return out


def _eager_stages(model, spec, opts, name, ids, fresh, ref, prog, timings):
    cap = EagerCapture(opts, name, keep_inputs=spec.dump is not None)
    compiled = torch.compile(model, backend=cap, fullgraph=True)
    t = time.perf_counter()
    with torch.no_grad(), prog.step("tracing the decode step (dynamo + AOTAutograd) and running the passes"):
        out0 = compiled(ids, fresh())
    timings["trace"] = time.perf_counter() - t
    report, rec = cap.report, cap.rec
    timings["passes"] = report.seconds
    stages = [_measured(None, out0, ref)]
    for p in report.passes:
        if not spec.numerics:
            break
        with torch.no_grad(), prog.step(f"decode step with the passes up to {p.name}"):
            if ran(p):
                cap.select(rec.after[p.name])
                stages.append(_measured(p.name, compiled(ids, fresh()), ref))
            else:
                stages.append(_unchanged(p.name, stages[-1]))
    alone = None
    culprit = _first_past(stages, spec.tol, ref.device) if spec.tol is not None and spec.numerics else None
    if culprit:
        with torch.no_grad(), prog.step(f"decode step with {culprit} alone"):
            _, rec1 = run_passes(rec.module(rec.input), spec.options(passes=(culprit,)), f"{name}-{culprit}-alone")
            cap.select(rec1.after.get(culprit, rec1.input))
            a, r = _err(compiled(ids, fresh()), ref)
            alone = dict(name=culprit, abs=a, rel=r)
    consts = {n.target: getattr(rec.root, n.target) for n in rec.input.nodes if n.op == "get_attr"}
    return report, rec, stages, dict(inputs=cap.inputs, constants=consts, user_outputs=cap.user_outputs,
                                     alone=alone)


def _first_past(stages: list[dict], tol: float, device) -> str | None:
    """The first pass whose stage error (worst over ranks) is past `tol`; None if none, or if the
    error is past it with no pass on. Collective at TP > 1, so every rank picks the same pass."""
    import torch.distributed as dist
    rel = torch.tensor([s.get("rel") or 0.0 for s in stages], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(rel, op=dist.ReduceOp.MAX)
    bad = [i for i, r in enumerate(rel.tolist()) if r > tol]
    return stages[bad[0]]["after"] if bad and bad[0] > 0 else None


def _inductor_stages(model, spec, opts, name, ids, fresh, ref, prog, timings):
    from ..compiler import _compile

    def compile_run(o: K3Options, mgr: PassManager):
        torch._dynamo.reset()
        def be(gm, ex):
            if isinstance(mgr.observer, Recorder):
                mgr.observer.input_names = input_names(gm)
            return _compile(gm, ex, o, manager=mgr)
        with torch.no_grad(), _quiet(), torch._inductor.config.patch(force_disable_caches=True):
            return torch.compile(model, backend=be, fullgraph=True)(ids, fresh())

    rec = Recorder()
    mgr = PassManager(opts, name=name, observer=rec)
    t = time.perf_counter()
    with prog.step("Inductor compile with all enabled passes"):
        out_all = compile_run(opts, mgr)
    timings["trace"] = time.perf_counter() - t
    if mgr.last is None:
        raise RuntimeError("the K3 pass manager did not run (Inductor reused a cached graph)")
    report = mgr.last
    timings["passes"] = report.seconds
    stages = []
    if spec.numerics:  # one Inductor compile per prefix; the last one is the compile above
        with prog.step("Inductor compile without K3 passes"):
            none = spec.options(passes=())
            stages.append(_measured(None, compile_run(none, PassManager(none)), ref))
        done: list[str] = []
        last = next((p.name for p in reversed(report.passes) if ran(p)), None)
        for p in report.passes:
            if not ran(p):
                stages.append(_unchanged(p.name, stages[-1]))
                continue
            done.append(p.name)
            with prog.step(f"Inductor compile with the passes up to {p.name}"):
                o = spec.options(passes=tuple(done))
                stages.append(_measured(p.name, out_all if p.name == last else compile_run(o, PassManager(o)), ref))
    return report, rec, stages, dict(inputs=None, constants={}, user_outputs=None,
                                     notes=["Inductor mode: the dumped graph is the post-grad graph; its inputs "
                                            "are not saved (numerics of `run --graph` on it are not checked)"]
                                     if spec.dump else [])


# ------------------------------------------------------------------------------------ graph runs
def run_graph(spec: RunSpec, path: str, trust_code: bool = False, sym: dict | None = None,
              tp: int | None = None, rank: int | None = None) -> dict:
    """Run the passes on a graph loaded from a file (one process). At TP > 1 a stand-in process
    group of that size lets the passes see the TP group (matching only: no real collectives)."""
    t0 = time.perf_counter()
    prog = Progress(spec.progress, 2 + len(PASSES))
    p = pathlib.Path(path)
    if p.is_dir() and not (p / "graph.json").exists() and dump_ranks(p):
        path = str(rank_dir(p, rank))  # a TP > 1 dump: one rank's graph
    try:
        with prog.step(f"loading {path}"):
            lg = graphio.load(path, trust_code=trust_code, sym=sym)
        notes = list(lg.notes)
        names = lg.group_names
        saved = next(iter(lg.groups.values()), None)  # [rank, size] as the writer saw it
        world = tp or (saved[1] if saved else 1)
        me = rank if rank is not None else (saved[0] if saved else 0)
        if me >= world:
            raise RankError(f"rank {me} is out of range for TP={world} (ranks 0..{world - 1})")
        if names and world == 1 and not saved:
            notes.append(f"the graph has collectives over group(s) {names} of unknown size: matched as TP=1 "
                         f"(give the TP size with --tp N)")
        with _stand_in_group(names, world, me) as stand_in:
            report, rec = run_passes(lg.gm, spec.options(), pathlib.Path(path).name)
        stages: list[dict] = []
        if spec.numerics and lg.inputs is not None and stand_in:
            notes.append(f"numerics not checked: the graph is TP={world} and its collectives need all ranks "
                         f"(matching used a stand-in process group)")
        elif spec.numerics and lg.inputs is not None:
            try:
                stages = _graph_stages(lg, rec, report, prog)
            except Exception as e:  # noqa: BLE001 - e.g. a CUDA graph on a CPU-only machine
                notes.append(f"numerics not checked: running the graph failed: {type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        res = dict(source="graph", rank=me, world=world, title=f"{path} ({lg.kind} graph)",
                   report=report.to_dict(), nodes=len(rec.input.nodes), stages=stages, ref_tokens=None,
                   timings=dict(passes=report.seconds), notes=notes, dump=None)
        if spec.dump:
            meta = {k: v for k, v in lg.meta.items() if k not in ("format", "version", "torch", "user_outputs")}
            meta.update(source="graph", graph=str(path), tp=world, rank=me,
                        groups={n: [me, world] for n in names} if stand_in else lg.groups)
            write_dump(pathlib.Path(spec.dump), rec, report, stages, meta, inputs=lg.inputs,
                       constants={n.target: getattr(lg.gm, n.target) for n in lg.gm.graph.nodes if n.op == "get_attr"},
                       user_outputs=lg.user_outputs)
            res["dump"] = spec.dump
        res["timings"]["total"] = time.perf_counter() - t0
        return res
    finally:
        prog.close()


@contextlib.contextmanager
def _stand_in_group(names: list[str], world: int, rank: int):
    """At TP > 1: a fake process group of `world` ranks (this one `rank`) that every group name the
    graph uses resolves to, for as long as the passes run. Yields whether it made one."""
    if not names or world == 1:
        yield False
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        _alias_groups(names)
        yield True
    finally:
        dist.destroy_process_group()


def _graph_stages(lg, rec: Recorder, report: CompileReport, prog: Progress) -> list[dict]:
    """The loaded graph after each pass, run on its saved inputs, against the graph without passes."""
    with torch.no_grad(), prog.step("running the graph without passes"):
        ref = _pick(_run_gm(lg.gm, lg.inputs), lg.user_outputs)
        stages = [_measured(None, ref, ref)]
    for p in report.passes:
        with torch.no_grad(), prog.step(f"running the graph with the passes up to {p.name}"):
            if ran(p):
                out = _pick(_run_gm(rec.module(rec.after[p.name]), lg.inputs), lg.user_outputs)
                stages.append(_measured(p.name, out, ref))
            else:
                stages.append(_unchanged(p.name, stages[-1]))
    return stages


def _alias_groups(names: list[str]) -> None:
    """Make every group name the graph uses resolve to the (fake) world group."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group
    from torch.distributed.distributed_c10d import _resolve_process_group
    for name in names:
        try:
            if dist.get_world_size(_resolve_process_group(name)) == dist.get_world_size():
                continue
        except Exception:  # noqa: BLE001 - unknown name: register it below
            pass
        _register_process_group(name, dist.group.WORLD)


def _run_gm(gm: GraphModule, inputs: list):
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in inputs]
    out = gm(*args)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _pick(outs: list, idx: list[int] | None) -> list:
    return outs if not idx else [outs[i] for i in idx]


# ------------------------------------------------------------------------------------ dumps
DUMP_GLOBS = ("[0-9][0-9]_*.before.py", "[0-9][0-9]_*.after.py", "graph.json", "graph.inputs.pt",
              "summary.json", "svg/layer_*.svg", "svg/index.html")


def write_dump(d: pathlib.Path, rec: Recorder, report: CompileReport, stages: list[dict], meta: dict,
               inputs=None, constants=None, user_outputs=None) -> list[pathlib.Path]:
    """Per pass NN_<pass>.before.py / .after.py, graph.json (+ graph.inputs.pt): the graph before
    any pass, loadable by `k3c run --graph`), svg/ (each layer before and after), summary.json."""
    from ..patterns.structure import analyze
    from . import svg

    d.mkdir(parents=True, exist_ok=True)
    clear_dump(d)  # a dump dir holds one run: drop what an earlier run left
    files = graphio.save_json(rec.input, d / "graph.json", meta=dict(meta, user_outputs=user_outputs),
                              inputs=inputs, constants=constants)
    pass_files = {}
    for i, name in enumerate(PASS_ORDER, 1):
        if name in rec.after:
            b, a = d / f"{i:02d}_{name}.before.py", d / f"{i:02d}_{name}.after.py"
            b.write_text(rec.readable(rec.before[name]))
            a.write_text(rec.readable(rec.after[name]))
            pass_files[name] = {"before": b.name, "after": a.name}
            files += [b, a]
    final = rec.final()
    svgs = svg.write_layers(d / "svg", rec.input, final, attention_before=analyze(rec.input).attention,
                            attention_after=analyze(final).attention)
    files += svgs
    summary = dict(k3c=dict(torch=torch.__version__), run=meta, report=report.to_dict(), numerics=stages,
                   files=dict(graph="graph.json", inputs="graph.inputs.pt" if inputs is not None else None,
                              passes=pass_files, svg=[str(f.relative_to(d)) for f in svgs]))
    (d / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    files.append(d / "summary.json")
    return files


class RankError(ValueError):
    """A rank that the dump or graph does not have (a bad --rank or --tp)."""


def is_dump(d: str | pathlib.Path) -> bool:
    """Whether `d` holds a k3c dump: a summary.json written by k3c, in `d` or in its rank<N>/."""
    d = pathlib.Path(d)
    for f in [d / "summary.json", *d.glob("rank[0-9]*/summary.json")]:
        try:
            summary = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(summary, dict) and "k3c" in summary:
            return True
    return False


def clear_dump(d: str | pathlib.Path) -> None:
    """Delete what a k3c dump writes in `d` (its files, svg/, rank<N>/); anything else stays."""
    d = pathlib.Path(d)
    for sub in d.glob("rank[0-9]*"):
        if sub.is_dir():
            clear_dump(sub)
            with contextlib.suppress(OSError):
                sub.rmdir()  # only if nothing else is left in it
    for pat in DUMP_GLOBS:
        for f in d.glob(pat):
            if f.is_file():
                f.unlink()
    with contextlib.suppress(OSError):
        (d / "svg").rmdir()


def dump_ranks(d: str | pathlib.Path) -> list[int]:
    """The ranks of a TP > 1 dump (its rank<N>/ folders with a summary.json), in order."""
    return sorted(int(f.parent.name[4:]) for f in pathlib.Path(d).glob("rank*/summary.json")
                  if f.parent.name[4:].isdigit())


def rank_dir(d: pathlib.Path, rank: int | None) -> pathlib.Path:
    """One rank's folder of a TP > 1 dump (default: rank 0)."""
    ranks = dump_ranks(d)
    rank = 0 if rank is None else rank
    if rank not in ranks:
        raise RankError(f"--rank {rank} is out of range for {d}: the dump has ranks {', '.join(map(str, ranks))}")
    return d / f"rank{rank}"


def read_summary(d: str | pathlib.Path, rank: int | None = None) -> tuple[pathlib.Path, dict]:
    """The dump directory of one rank and its summary.json (a TP > 1 dump has rank0/, rank1/, ...)."""
    d = pathlib.Path(d)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such directory (make one with `k3c run --dump {d}`)")
    one_rank = (d / "summary.json").exists()
    if not one_rank and dump_ranks(d):
        d = rank_dir(d, rank)
    f = d / "summary.json"
    if not f.exists():
        raise FileNotFoundError(f"{d}: no summary.json here: not a `k3c run --dump` directory")
    try:
        summary = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: unreadable ({e})") from None
    saved = summary.get("run", {}).get("rank", 0) if isinstance(summary, dict) else 0
    if one_rank and rank is not None and rank != saved:
        raise RankError(f"--rank {rank} is out of range for {d}: the dump has rank {saved} only")
    return d, summary
