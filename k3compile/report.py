"""Match reports: per pass, sites matched vs expected and why each near-miss failed."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class NearMiss:
    site: str        # the anchor node matching started from
    stopped_at: str  # the node where matching stopped
    reason: str
    node: str = ""   # the stopping node as code: `add_5 = aten.add.Tensor(mm_3, arg12_1)`
    source: str = ""  # the model source line it came from (`file:line: code`), when the graph has it
    module: str = ""  # the module the site belongs to (`layers.3.attn`), when the graph has it

    def __str__(self) -> str:
        return f"at {self.site}: stopped at {self.stopped_at}: {self.reason}"


def node_code(n) -> str:
    """`name = target(args)` for an FX node (plain text; '' for a non-node)."""
    from torch.fx import Node
    if not isinstance(n, Node):
        return ""
    if n.op == "placeholder":
        return f"{n.name} = <graph input>"
    if n.op == "get_attr":
        return f"{n.name} = self.{n.target}"
    if n.op == "output":
        return "return (graph output)"
    t = n.target
    name = str(t) if hasattr(t, "_schema") else getattr(t, "__name__", str(t))  # aten.mm.default, getitem
    fmt = lambda a: a.name if isinstance(a, Node) else (  # noqa: E731
        "[" + ", ".join(fmt(x) for x in a) + "]" if isinstance(a, (list, tuple)) else repr(a))
    args = [fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items()]
    text = f"{n.name} = {name}({', '.join(args)})"
    return text if len(text) <= 200 else text[:197] + "..."


def clean_path(path: str) -> str:
    """Dynamo's `L['self'].layers.3.attn` / `L['self']._modules['layers']._modules['3']` -> `layers.3.attn`."""
    import re
    path = re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", str(path))
    return re.sub(r"^L\['self'\]\.?|^L\['([^']+)'\]", r"\1", path)


def node_module(n) -> str:
    """The innermost module an FX node was traced in (`layers.3.attn`), '' if unknown."""
    meta = getattr(n, "meta", None)
    st = meta.get("nn_module_stack") if isinstance(meta, dict) else None
    if not st:
        return ""
    return clean_path(list(st.values())[-1][0])


def node_source(n) -> str:
    """The innermost frame of the node's `stack_trace` meta as `file:line: code` ('' if none)."""
    meta = getattr(n, "meta", None)
    st = meta.get("stack_trace") if isinstance(meta, dict) else None
    if not st:
        return ""
    lines = [ln for ln in st.rstrip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        ln = lines[i].strip()
        if ln.startswith("File "):
            try:
                path, rest = ln[len('File "'):].split('", line ', 1)
                lineno = rest.split(",")[0]
            except ValueError:
                return ln
            code = next((c.strip() for c in lines[i + 1:] if not set(c.strip()) <= set("^~ ")), "")
            return f"{path}:{lineno}: {code}"
    return ""


@dataclass
class PassReport:
    name: str
    expected: int = 0
    matched: int = 0
    near_misses: list[NearMiss] = field(default_factory=list)
    skipped: str | None = None   # the whole pass did not run, and why
    error: str | None = None     # the pass raised; the graph was rolled back
    notes: list[str] = field(default_factory=list)     # extra facts (e.g. prefetches placed)
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0

    def miss(self, site, stopped_at, reason: str) -> None:
        name = lambda n: getattr(n, "name", str(n))  # noqa: E731
        self.near_misses.append(NearMiss(name(site), name(stopped_at), reason, node_code(stopped_at),
                                         node_source(stopped_at) or node_source(site),
                                         node_module(site) or node_module(stopped_at)))

    @property
    def ok(self) -> bool:
        return self.error is None and self.skipped is None and self.matched == self.expected

    def status(self) -> str:
        if self.error:
            return f"ERROR, rolled back: {self.error}"
        if self.skipped:
            return f"skipped: {self.skipped}"
        s = f"{self.matched}/{self.expected} sites"
        if self.matched < self.expected:
            s += f" ({self.expected - self.matched} missed)"
        return s

    def line(self) -> str:
        return f"{self.name:<24} {self.status()}  [{self.seconds * 1e3:.1f} ms]"


@dataclass
class CompileReport:
    graph: str = ""
    structure: dict = field(default_factory=dict)
    passes: list[PassReport] = field(default_factory=list)
    seconds: float = 0.0
    cache_hit: bool = False  # Inductor loaded the compiled graph from its cache: no pass ran now
    blocked: str | None = None  # why no pass could apply to this graph at all (its dtype), one line

    @property
    def is_k3(self) -> bool:
        st = self.structure
        return bool(st.get("attention_layers") or st.get("moe_layers") or st.get("routers"))

    @property
    def ok(self) -> bool:
        return all(p.ok or (p.skipped and not p.expected) for p in self.passes)

    def render(self, near_misses: bool = True) -> str:
        if self.cache_hit:
            return (f"k3: {self.graph}: loaded from Inductor's cache, compiled earlier with the same K3 passes "
                    f"and options; no match report now (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 recompiles)")
        if not self.is_k3:
            st = self.structure
            if st.get("residual_adds"):   # a residual stream, but no delta took a K3 role
                return (f"k3: {self.graph}: no K3 layer found: a residual stream of {st['residual_adds']} add(s), "
                        f"none an attention o-proj or a MoE ({st.get('unclassified') or 'no router top-k'}); "
                        f"compiled without K3 passes")
            return (f"k3: {self.graph}: nothing matched: no K3 structure found "
                    f"(no residual stream of [M, hidden] adds, no router top-k, no known attention or expert op); "
                    f"compiled without K3 passes")
        st = self.structure
        head = (f"k3: {self.graph}: {st.get('attention_layers', 0)} attention layers, "
                f"{st.get('moe_layers', 0)} MoE layers, TP={st.get('tp')}, M={st.get('m')}, "
                f"dtype={st.get('dtype')}")
        lines = [head] + (["  " + self.blocked] if self.blocked else [])
        if st.get("moe_ops"):   # MoE layers whose selection, experts and finalize are another project's op
            lines.append(f"  MoE layers in an opaque op ({', '.join(st['moe_ops'])}): its router logits, latent and "
                         "latent tail take K3 roles; what runs inside it does not")
        if st.get("unclassified"):   # a residual add whose delta takes no role: the layers around it are not counted
            lines.append(f"  residual stream: {st['unclassified']}")
        lines += ["  " + p.line() for p in self.passes]
        if near_misses:
            for p in self.passes:
                for nm in p.near_misses[:10]:
                    lines.append(f"    {p.name} near-miss {nm}")
                if len(p.near_misses) > 10:
                    lines.append(f"    {p.name}: {len(p.near_misses) - 10} more near-misses")
                for note in p.notes:
                    lines.append(f"    {p.name}: {note}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CompileReport":
        """Inverse of `to_dict` (e.g. a report read back from the CLI's summary.json)."""
        d = dict(d)
        passes = []
        for p in d.pop("passes", []):
            p = dict(p)
            nms = [NearMiss(**nm) for nm in p.pop("near_misses", [])]
            passes.append(PassReport(**p, near_misses=nms))
        return cls(**d, passes=passes)

    def get(self, name: str) -> PassReport:
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(f"no report for pass {name!r}; passes run: {[p.name for p in self.passes]}")


_REPORTS: list[CompileReport] = []


def record(r: CompileReport) -> None:
    _REPORTS.append(r)


def reports() -> list[CompileReport]:
    """Every compile's report in this process, oldest first."""
    return list(_REPORTS)


def last_report() -> CompileReport | None:
    return _REPORTS[-1] if _REPORTS else None


def clear_reports() -> None:
    _REPORTS.clear()
