"""The contract every K3 pass follows.

A pass is one file in this package holding one `K3Pass` subclass; its module docstring says
what it matches, what it emits and when it is skipped. `run` first collects every site without
touching the graph (so a near-miss costs nothing), then rewrites the matched sites.
"""
from __future__ import annotations

from torch.fx import Graph

from ..options import K3Options
from ..patterns.structure import GraphInfo
from ..report import PassReport
from .pipeline import CUDA_PROFITABLE_M, CUDA_UNMEASURED


def gated_off(name: str, info: GraphInfo, opts: K3Options) -> str | None:
    """Why the profitability gate keeps `name` (a pass, or a feature such as "prefetch") out of this
    graph, or None: on CUDA with Inductor and gate="measured", only the M in its pipeline row's cuda_m. A
    dynamic-M graph (vLLM's general graph) gets every pass with a non-empty range: its ops switch to
    their unfused paths at run time outside the tuned ranges (kernels/tuning.py ONESHOT_M)."""
    if opts.gate != "measured" or opts.mode != "inductor" or info.device != "cuda" or name in opts.ungated:
        return None
    m = info.m_static
    lo, hi = CUDA_PROFITABLE_M.get(name, (1, 0))
    if (lo <= m <= hi) if m is not None else lo <= hi:
        return None
    where = f"M={'dynamic' if m is None else m}"
    if name in CUDA_UNMEASURED:
        return (f"not applied ({where}): on CUDA with Inductor a pass applies only where the per-layer "
                f"benchmark measured it faster, and {name} has not been measured on the GPU yet "
                f"(passes/pipeline.py); gate='off', K3_GATE=off or K3_UNGATED={name} applies it")
    measured = f"M in [{lo}, {hi}]" if lo <= hi else "no M"
    return (f"not applied ({where}): on CUDA with Inductor the per-layer benchmark "
            f"measured {name} faster than Inductor alone at {measured} (passes/pipeline.py); gate='off' or K3_GATE=off applies it")


class K3Pass:
    name: str = ""
    description: str = ""  # one line: what it replaces with what
    pattern: str = ""      # one line: the op chain it matches, per site
    emits: str = ""        # the k3:: op(s) it emits
    # "KDA" / "MLA": the pass rewrites the reference model's attention-core op of that kind; in a graph
    # whose layers were found by role and that has none of the known core ops, it is skipped with that reason
    core: str | None = None
    # passes whose emitted ops this one anchors on (its pipeline row's, set by @register): where one of
    # them does not run in a compile (disabled, skipped, gated off or rolled back), this pass is skipped
    # with that reason, not reported as 0/N sites with a near-miss at every site
    needs: tuple[str, ...] = ()

    def expected(self, info: GraphInfo) -> int:
        """How many sites the graph's layer structure says should match."""
        raise NotImplementedError

    def skip_reason(self, info: GraphInfo, opts: K3Options) -> str | None:
        """Why the whole pass does not apply to this graph (None: it applies)."""
        dt = str(info.dtype).replace("torch.", "") if info.dtype else None
        if dt is not None and dt not in opts.dtypes:
            return f"model dtype {dt} is not supported by the fused ops (supported: {', '.join(opts.dtypes)})"
        if info.tp not in opts.tp_sizes:
            return f"TP={info.tp} is not supported by the fused ops (supported: {list(opts.tp_sizes)})"
        lo, hi = opts.m_ranges.get(self.name, (1, 1 << 30))
        m = info.m_static
        if m is not None and not lo <= m <= hi:
            return f"M={m} is outside this pass's batch range [{lo}, {hi}]"
        return gated_off(self.name, info, opts)

    def run(self, graph: Graph, info: GraphInfo, opts: K3Options, report: PassReport) -> None:
        raise NotImplementedError

    @staticmethod
    def collect(anchors, match, report: PassReport) -> list:
        """match(anchor) for every anchor; Fails become near-misses, the rest are returned.

        A site vLLM already fused (`patterns.vllm_forms.Prefused`) is neither: it is left alone,
        does not count towards `report.expected`, and is listed in one note. A site in a form no K3 op
        takes (`patterns.graph.NoSite`: inside another project's opaque op, ...) is a near-miss with its
        reason that does not count towards `report.expected` either."""
        from ..patterns.graph import Fail, NoSite
        from ..patterns.vllm_forms import Prefused
        sites, pre = [], []
        for a in anchors:
            m = match(a)
            if isinstance(m, Prefused):
                pre.append((a, m))
            elif isinstance(m, NoSite):
                report.expected -= 1
                report.miss(a, m.node, f"{m.reason} (not counted as expected)")
            elif isinstance(m, Fail):
                report.miss(a, m.node, m.reason)
            else:
                sites.append(m)
        if pre:
            report.expected -= len(pre)
            report.notes.append(f"{len(pre)} site(s) {pre[0][1].reason}, not counted as expected: "
                                + ", ".join(f"{getattr(a, 'name', a)} (at {getattr(m.node, 'name', m.node)})"
                                            for a, m in pre))
        return sites
