"""Runs the K3 passes in the order of passes/pipeline.py over a post-grad graph and writes the match report.

Used as Inductor's `post_grad_custom_post_pass` (a `CustomGraphPass`, so the FX graph cache
keys on `uuid()`), or directly on a graph in the backend's "eager" mode and in the CLI.
A pass that raises leaves the graph exactly as it was (it is restored from a copy) and warns;
`strict=True` turns that, and any expected site that did not match, into an error.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import pathlib
import time
import warnings

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph

from ..ops import describe_kernels
from ..config import knobs
from ..options import K3Options
from ..patterns.graph import erase_collectives, orphan_collectives
from ..patterns.roles import VLLM_ATTENTION_OPS, op_name as _op_name
from ..patterns.structure import GraphInfo, analyze
from ..report import CompileReport, PassReport, record
from .canonicalize import canonicalize, is_inductor_addmm
from ..patterns.vllm_forms import has_vllm_attn_res
from .pipeline import passes as _pipeline_passes

log = logging.getLogger("k3compile")

# every pass of the pipeline table (passes/pipeline.py), in its order
PASSES = _pipeline_passes()


def _found_any(info: GraphInfo) -> bool:
    """Anything the passes anchor on: residual adds, known attention / expert ops, or a router."""
    return bool(info.stream or info.attention or info.experts or info.routers)


class K3StrictError(RuntimeError):
    pass


def snapshot(graph: Graph) -> Graph:
    """A copy of `graph`: same node names; each node's meta dict is copied, its values shared."""
    g = Graph()
    out = g.graph_copy(graph, {})
    g.output(out)
    return g


def _restore(graph: Graph, snap: Graph) -> None:
    for n in reversed(list(graph.nodes)):
        graph.erase_node(n)
    out = graph.graph_copy(snap, {})
    graph.output(out)


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    root = pathlib.Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for sub in ("passes", "patterns", "ops"):
        for f in sorted((root / sub).glob("*.py")):
            h.update(f.read_bytes())
    return h.hexdigest()


class PassManager(CustomGraphPass):
    def __init__(self, opts: K3Options | None = None, passes: dict | None = None, name: str = "graph",
                 dump: bool = False, observer=None, compile_range: tuple[int, int] | None = None):
        """dump=True records (pass, readable graph before it, readable graph after it) in `graphs`
        for every pass that runs. `observer(stage, pass_name, graph)` is called with stage "input"
        (the graph as received, pass_name None), then "before" and "after" around every pass that
        runs (the CLI snapshots graphs there)."""
        self.opts = opts or K3Options.make()
        self.passes = passes if passes is not None else PASSES
        self.name = name
        self.dump = dump
        self.observer = observer
        # [lo, hi] tokens the graph is compiled for (vLLM's compile range); a pass whose batch range
        # (options.m_ranges) does not contain it is skipped. None: no range known (plain torch.compile).
        self.compile_range = compile_range
        self.last: CompileReport | None = None
        self.compile_note: str | None = None  # the compiler's own fact for this compile (Inductor PDL), a report note
        self.graphs: list[tuple[str, str, str]] = []  # (pass, readable graph before, after) when dump=True

    def uuid(self):
        import torch.distributed as dist
        rank = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        # the rewrite bakes in this rank's shard offsets, so the rank is part of the key; so are the
        # options (the user switches read when they were made) and every experiment knob (config.Knobs),
        # so that a changed setting never reuses a graph Inductor's cache holds from before
        return f"{_source_hash()}:{self.opts.key()}:{rank}:{torch.__version__}:{knobs().key()}"

    def __call__(self, graph: Graph) -> None:
        register_inductor_fallbacks()
        try:
            self._run(graph)
        except K3StrictError:
            raise
        except Exception as e:  # never let the compiler's own bookkeeping break a user's compile
            if self.opts.strict:
                raise K3StrictError(f"k3 pass manager failed: {type(e).__name__}: {e}") from e
            warnings.warn(f"k3: pass manager failed ({type(e).__name__}: {e}); graph left unoptimised", stacklevel=2)

    def _observe(self, stage: str, name: str | None, graph: Graph) -> None:
        if self.observer is not None:
            self.observer(stage, name, graph)

    def _run(self, graph: Graph) -> None:
        t0 = time.perf_counter()
        self._observe("input", None, graph)
        info = analyze(graph)
        # vLLM's AttnRes kernel holds the residual stream's adds: no stream is visible before canonicalising
        if _found_any(info) or has_vllm_attn_res(graph):
            if canonicalize(graph):
                info = analyze(graph)  # e.g. vLLM's all-reduce became c10d's: now the TP group is visible
        elif any(is_inductor_addmm(n) for n in graph.nodes):
            # Inductor's addmm folds may hide every residual add: canonicalised, is anything found?
            # (a graph without any is left exactly as Inductor gave it)
            snap = snapshot(graph)
            canonicalize(graph)
            info = analyze(graph)
            if not _found_any(info):
                _restore(graph, snap)
                info = analyze(graph)
        report = CompileReport(graph=self.name, structure=info.summary())
        found = info   # the structure as found before any pass: every pass's expected sites derive from it
        core_names = {_op_name(n) for n in found.attention}
        vllm_cores = sorted(core_names & VLLM_ATTENTION_OPS)
        report.blocked = _dtype_gate(info, self.opts) if report.is_k3 else None
        # One copy of the graph, taken before the first pass that runs; a pass that raises restores it
        # and the passes that succeeded since are applied again (they are deterministic). A copy per
        # pass was half of the pass manager's time on a 93-layer graph.
        base, done = None, []
        for name, p in self.passes.items():
            pr = PassReport(name)
            report.passes.append(pr)
            pr.expected = p.expected(found) if report.is_k3 else 0
            if name not in self.opts.passes:
                pr.skipped = "disabled by options"
                continue
            if not report.is_k3:
                pr.skipped = "no K3 structure in this graph"
                continue
            if (pr.expected == 0 and getattr(p, "core", None) and found.by_role
                    and len(vllm_cores) == len(core_names)):
                pr.skipped = (f"no {p.core} attention-core op of the reference model (k3model::{p.core.lower()}_decode "
                              "or the k3:: ops the folds before it emit) in this graph: this fold rewrites that op; "
                              "the passes that act around the cores do not need it"
                              + (f" (vLLM's own cores here, {', '.join(vllm_cores)}, are not rewritten)"
                                 if vllm_cores else ""))
                continue
            reason = _needs_reason(p, report) or p.skip_reason(info, self.opts) or self._range_reason(name)
            if reason:
                pr.skipped = reason
                continue
            pr.nodes_before = len(graph.nodes)
            # fresh nodes (earlier passes, or a rollback, replaced some); the TP group, M and dtype as
            # first seen: once the passes have taken every collective the graph no longer shows them
            info = _refresh(info, graph)
            if base is None:
                base = snapshot(graph)
            before = _readable(graph) if self.dump else None
            _trace_graph(f"k3_{name}_before", graph)
            self._observe("before", name, graph)
            t = time.perf_counter()
            try:
                _apply(p, graph, info, self.opts, pr)
                done.append(p)
            except Exception as e:  # roll back: the graph stays as it was before this pass
                _restore(graph, base)
                for q in done:
                    _apply(q, graph, _refresh(info, graph), self.opts, PassReport(q.name))
                pr.error = f"{type(e).__name__}: {e}"
                pr.matched = 0
                if self.opts.strict:
                    raise K3StrictError(f"k3 pass {name} failed: {pr.error}") from e
                warnings.warn(f"k3 pass {name} failed and was rolled back: {pr.error}", stacklevel=2)
            pr.seconds = time.perf_counter() - t
            pr.nodes_after = len(graph.nodes)
            _trace_graph(f"k3_{name}_after", graph)
            self._observe("after", name, graph)
            if self.dump:
                self.graphs.append((name, before, _readable(graph)))
        kernels = describe_kernels(info.device, info.group, _moe_shapes(info)) if report.is_k3 else None  # None off CUDA
        if kernels:
            report.passes[-1].notes.append(kernels)
        if report.is_k3 and report.passes and self.compile_note:
            report.passes[-1].notes.append(self.compile_note)
        report.seconds = time.perf_counter() - t0
        self.last = report
        record(report)
        text = report.render()
        (print if self.opts.verbose else log.info)(text)
        _trace(report, graph)
        if report.blocked:
            if self.opts.strict:
                raise K3StrictError(f"k3: {report.blocked}")
            warnings.warn(f"k3: {report.blocked}", stacklevel=2)
        missing = [p for p in report.passes if p.name in self.opts.passes and not p.skipped and not p.error
                   and p.matched < p.expected]
        if missing:
            msg = "; ".join(f"{p.name}: {p.matched}/{p.expected} sites" + (f" (first near-miss {p.near_misses[0]})"
                                                                          if p.near_misses else "")
                            for p in missing)
            if self.opts.strict:
                raise K3StrictError(f"k3: expected sites did not match: {msg}")
            warnings.warn(f"k3: expected sites did not match: {msg}", stacklevel=2)

    def _range_reason(self, name: str) -> str | None:
        if self.compile_range is None:
            return None
        lo, hi = self.opts.m_ranges.get(name, (1, 1 << 30))
        s, e = self.compile_range
        if lo <= s and e <= hi:
            return None
        return f"compile range [{s}, {e}] is not inside this pass's batch range [{lo}, {hi}]"


def _dtype_gate(info: GraphInfo, opts: K3Options) -> str | None:
    """One line when the graph's dtype keeps every enabled pass off (options.dtypes), else None."""
    dt = str(info.dtype).replace("torch.", "") if info.dtype else None
    if dt is None or dt in opts.dtypes or not opts.passes:
        return None
    return (f"{dt} graph: the fused ops accept {' / '.join(opts.dtypes)} only (options dtypes={opts.dtypes}); "
            f"no K3 rewrite applied (build the model in {opts.dtypes[0]}, or pass dtypes=[..., '{dt}'])")


def _needs_reason(p, report: CompileReport) -> str | None:
    """Why `p` cannot run here because a pass it anchors on (p.needs) did not run in this compile."""
    for need in p.needs:
        pr = next((q for q in report.passes if q.name == need), None)
        why = ("not in this pass manager" if pr is None else f"skipped: {pr.skipped}" if pr.skipped
               else f"rolled back: {pr.error}" if pr.error else None)
        if why:
            return f"needs {need}'s ops, and {need} did not run here ({why})"
    return None


_FALLBACKS_DONE: set = set()


def register_inductor_fallbacks() -> int:
    """Register every k3:: and k3model:: op with Inductor as a fallback kernel (what Inductor's
    implicit fallback makes of a custom op on first sight, with the same layout constraint: the
    op's tag, else the default), before Inductor lowers a graph holding them; returns how many were
    new. Inductor's implicit path first logs `operator_str(target, args, kwargs)`, which torch 2.11
    formats eagerly, and an argument's IR string holds the whole chain of fallback kernels before it,
    shared inputs repeated: in a graph of k3 ops it doubles with each op (the 4-layer tiny model's
    compile spent minutes in it on the GPU: BENCHMARKS.md). vLLM
    takes its own ops past that path for the same reason. Best-effort: where Inductor's internals
    differ, the implicit path runs as before."""
    try:
        from torch._inductor import lowering as L
        from torch._library.utils import get_layout_constraint_tag
        names = [n for n in torch._C._dispatch_get_all_op_names()
                 if n.startswith(("k3::", "k3model::")) and n not in _FALLBACKS_DONE]
    except Exception:  # noqa: BLE001 - another torch: the implicit fallback still works
        return 0
    new = 0
    for name in names:
        _FALLBACKS_DONE.add(name)
        ns, _, rest = name.partition("::")
        op_name, _, overload = rest.partition(".")
        try:
            op = getattr(getattr(getattr(torch.ops, ns), op_name), overload or "default")
            if op in L.lowerings:
                continue
            tag = get_layout_constraint_tag(op, with_default=True)
            L.make_fallback(op, layout_constraint=L.tag_to_layout_constraint(tag), warn=False)
            new += 1
        except Exception as e:  # noqa: BLE001
            log.debug("k3: no Inductor fallback registered for %s: %s", name, e)
    return new


def _refresh(info: GraphInfo, graph: Graph) -> GraphInfo:
    """`info` with the graph's current attention and expert nodes (earlier passes, or a rollback,
    replaced some); the TP group, M and dtype as first seen: once the passes have taken every
    collective the graph no longer shows them."""
    fresh = analyze(graph)
    return dataclasses.replace(info, attention=fresh.attention, experts=fresh.experts, stream=fresh.stream,
                               layers=fresh.layers, routers=fresh.routers)


def _apply(p, graph: Graph, info: GraphInfo, opts: K3Options, pr: PassReport) -> None:
    """Run one pass, then drop what its rewrites left dead: the replaced consumers, then the
    collectives they fed (FX's dead-code elimination keeps collectives) and, by DCE, their GEMMs."""
    orphans = orphan_collectives(graph)  # a graph may come with some; only the pass's own go
    p.run(graph, info, opts, pr)
    stable_topological_sort(graph)
    graph.eliminate_dead_code()
    left = orphan_collectives(graph) - orphans
    if left:
        erase_collectives(graph, left)
        graph.eliminate_dead_code()
    graph.lint()


def _readable(graph: Graph) -> str:
    gm = graph.owning_module
    if gm is not None:
        return gm.print_readable(print_output=False)
    return str(graph)


def _trace_graph(name: str, graph: Graph) -> None:
    """One graph as a structured-trace artifact (free unless TORCH_TRACE is set: the payload is lazy)."""
    try:
        from torch._logging import trace_structured
        trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"},
                         payload_fn=lambda: _readable(graph))
    except Exception:  # tracing is best-effort
        pass


def _trace(report: CompileReport, graph: Graph) -> None:
    """Structured-trace artifacts (TORCH_TRACE=dir, then tlparse)."""
    try:
        from torch._logging import trace_structured
        trace_structured("artifact", metadata_fn=lambda: {"name": "k3_match_report", "encoding": "string"},
                         payload_fn=lambda: report.render())
        trace_structured("artifact", metadata_fn=lambda: {"name": "k3_graph_after_passes", "encoding": "string"},
                         payload_fn=lambda: _readable(graph))
    except Exception:  # tracing is best-effort
        pass


def _moe_shapes(info: GraphInfo) -> tuple | None:
    """(I, L, K, M, bf16) of the graph's first routed-expert op, for the kernel note (which MXFP4
    expert kernel runs), or None."""
    if not info.experts:
        return None
    x, ids, w13 = (getattr(a, "meta", {}).get("val") for a in info.experts[0].args[:3])
    if not all(isinstance(t, torch.Tensor) for t in (x, ids, w13)):
        return None
    M = x.shape[0] if isinstance(x.shape[0], int) else None
    return w13.shape[1] // 2, x.shape[1], ids.shape[1], M, x.dtype == torch.bfloat16
