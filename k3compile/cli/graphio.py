"""Save and load FX graphs for `k3c run --graph FILE`.

Formats, chosen by file suffix:
- `.json` (written by `k3c run --dump`): the graph as data: every node's op, target (an op name),
  arguments, the shape/stride/dtype/device of its value, its module path and source line. The whole
  file is checked before FX generates code from it (`_check_node`): names, placeholder / get_attr
  targets and keyword names must be Python identifiers, call targets resolve only to ops of
  `OP_NAMESPACES`, the functionalisation HOPs and a fixed set of Python operators; nothing from the
  file is executed. The graph's real inputs (weights, cache, token ids), when saved, sit next to it
  in `<stem>.inputs.pt` (tensors only, read with `torch.load(weights_only=True)`).
- `.pt2`: a `torch.export` program. Without `trust_code` the archive is checked first
  (`check_pt2`): no pickled weights, constants or objects, sample inputs readable as plain tensors,
  no compiled code, allow-listed node targets, identifiers for names and plain size expressions.
  It is decomposed with Inductor's decomposition table (the ATen forms the passes see after
  AOTAutograd); its weights and saved example inputs are used to check numerics.
- `.py`: a readable graph: `GraphModule.print_readable` output (ours, TORCH_COMPILE_DEBUG's
  fx_graph_readable.py / fx_graph_transformed.py, vLLM's debug dumps) or TORCH_COMPILE_DEBUG's
  fx_graph_runnable.py. It is Python that must be executed to load, so it loads only with
  `trust_code=True` (`--trust-code`). Input shapes come from the `forward` annotations
  (`"bf16[2, 64]"`) or the file's `load_args`; symbolic sizes take the values given in `sym`.
"""
from __future__ import annotations

import json
import keyword
import logging
import math
import operator
import pathlib
import re
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

FORMAT = "k3c-graph"
VERSION = 1
DEFAULT_SYM = 8  # value given to a symbolic size in a .py graph when --sym does not name it


class GraphFileError(Exception):
    """The file cannot be read as a graph (the message is one line for the user)."""


class UntrustedCodeError(GraphFileError):
    pass


@dataclass
class LoadedGraph:
    gm: GraphModule
    kind: str                                   # "k3c json", "torch.export", "python"
    inputs: list | None = None                  # real tensors for the placeholders, in order
    user_outputs: list[int] | None = None       # which graph outputs are the model's outputs
    groups: dict = field(default_factory=dict)  # process-group name -> [rank, size] when known
    meta: dict = field(default_factory=dict)    # what the writer recorded (model, batch, ...)
    notes: list[str] = field(default_factory=list)

    @property
    def group_names(self) -> list[str]:
        return collective_groups(self.gm.graph)


def collective_groups(graph: Graph) -> list[str]:
    """Names of the process groups the graph's functional collectives use, in first-use order."""
    out: list[str] = []
    for n in graph.nodes:
        if n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "_c10d_functional":
            g = n.args[-1] if n.args else None
            if isinstance(g, str) and g not in out:
                out.append(g)
    return out


# ---------------------------------------------------------------------------------------- ops
def op_qualname(op) -> str:
    return f"{op._schema.name}.{op._overloadname}"  # aten::mm.default


# Op namespaces a graph file may call (anything else is refused before a node is built): ATen and
# prims, the functional collectives, this package's ops, and vLLM's / FlashInfer's / fla-core's ops.
OP_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
                           "c10d", "symm_mem", "k3", "k3model", "vllm", "_C", "_C_cache_ops", "_C_custom_ar",
                           "_moe_C", "vllm_ir", "flashinfer", "fla"})
# higher-order ops a graph file may name: the functionalisation wrappers of mutating ops (their
# first argument is an op overload, itself resolved through OP_NAMESPACES)
HOPS = frozenset({"auto_functionalized", "auto_functionalized_v2"})


def is_ident(s) -> bool:
    return isinstance(s, str) and s.isidentifier() and not keyword.iskeyword(s)


def _dotted(s) -> bool:
    return isinstance(s, str) and all(is_ident(p) for p in s.split("."))


def resolve_op(q: str):
    """`ns::name.overload` -> the OpOverload, or a one-line error naming what to load."""
    try:
        ns, rest = q.split("::", 1)
        name, overload = rest.rsplit(".", 1)
    except (ValueError, AttributeError):
        raise GraphFileError(f"malformed op name {q!r}") from None
    if not (is_ident(ns) and is_ident(name) and is_ident(overload)):
        raise GraphFileError(f"malformed op name {q!r}")
    if ns not in OP_NAMESPACES:
        raise GraphFileError(f"the graph calls {ns}::{name}.{overload}: op namespace {ns!r} is not one k3c loads "
                             f"({', '.join(sorted(OP_NAMESPACES))})")
    if ns == "k3model":
        import k3compile.model  # noqa: F401  (registers torch.ops.k3model.*)
    elif ns == "k3":
        import k3compile.ops  # noqa: F401  (registers torch.ops.k3.*)
    try:
        op = getattr(getattr(getattr(torch.ops, ns), name), overload)
        if not isinstance(op, torch._ops.OpOverload):
            raise AttributeError(q)
        return op
    except (AttributeError, RuntimeError):
        hint = " (vLLM's ops: install and import vllm)" if ns in ("vllm", "_C", "vllm_ir", "_moe_C") else ""
        raise GraphFileError(f"the graph calls {ns}::{name}.{overload}, which is not registered in this "
                             f"process{hint}") from None


# Python callables a .json graph may name: FX's operators on values; nothing that reaches code.
_PY_FUNCS = {f"_operator.{n}": getattr(operator, n) for n in (
    "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
    "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "not_")}
_PY_FUNCS.update({f"math.{n}": getattr(math, n) for n in ("ceil", "floor", "sqrt", "trunc")})
_PY_FUNCS.update({f"torch.{n}": getattr(torch, n) for n in (
    "sym_max", "sym_min", "sym_float", "sym_int", "sym_not", "sym_ite", "sym_sum") if hasattr(torch, n)})
_PY_NAMES = {id(f): k for k, f in _PY_FUNCS.items()}


def _enc_target(t) -> Any:
    if isinstance(t, torch._ops.OpOverload):
        return {"op": op_qualname(t)}
    if isinstance(t, torch._ops.HigherOrderOperator):
        return {"hop": t.name()}
    if id(t) in _PY_NAMES:
        return {"py": _PY_NAMES[id(t)]}
    raise GraphFileError(f"cannot save a graph that calls {getattr(t, '__qualname__', t)!r} "
                         f"(only torch ops and Python operators)")


def _dec_target(d):
    if "op" in d:
        return resolve_op(d["op"])
    if not isinstance(d, dict) or len(d) != 1:
        raise GraphFileError(f"a call target must be {{\"op\": ...}}, {{\"hop\": ...}} or {{\"py\": ...}}, got {_short(d)}")
    if "op" in d:
        return resolve_op(d["op"])
    if "hop" in d:
        if d["hop"] not in HOPS:
            raise GraphFileError(f"the graph names higher-order op {_short(d['hop'])}, which k3c does not load "
                                 f"({', '.join(sorted(HOPS))})")
        try:
            return getattr(torch.ops.higher_order, d["hop"])
        except AttributeError:
            raise GraphFileError(f"unknown higher-order op {d['hop']!r} in this torch version") from None
    if "py" in d and isinstance(d["py"], str) and d["py"] in _PY_FUNCS:
        return _PY_FUNCS[d["py"]]
    raise GraphFileError(f"the graph names a Python function that k3c does not load: {_short(d)}")


def _short(x, n: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= n else r[:n] + "...'"


# ---------------------------------------------------------------------------------------- values
_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise GraphFileError(f"unknown dtype {name!r}")
    return _DTYPES[name]


def _enc(a) -> Any:
    if isinstance(a, Node):
        return {"n": a.name}
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if isinstance(a, float):
        return a if math.isfinite(a) else {"float": repr(a)}
    if isinstance(a, tuple):
        return {"tuple": [_enc(x) for x in a]}
    if isinstance(a, list):
        return [_enc(x) for x in a]
    if isinstance(a, dict):
        return {"dict": {str(k): _enc(v) for k, v in a.items()}}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.layout):
        return {"layout": str(a).removeprefix("torch.")}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).removeprefix("torch.")}
    if isinstance(a, slice):
        return {"slice": [_enc(a.start), _enc(a.stop), _enc(a.step)]}
    if isinstance(a, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return {"target": _enc_target(a)}
    if a is Ellipsis:
        return {"ellipsis": True}
    raise GraphFileError(f"cannot save an argument of type {type(a).__name__} ({a!r})")


def _dec(a, env: dict) -> Any:
    if isinstance(a, list):
        return [_dec(x, env) for x in a]
    if not isinstance(a, dict):
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise GraphFileError(f"malformed value {_short(a)}")
    if len(a) != 1:
        raise GraphFileError(f"malformed value {_short(a)}")
    (k, v), = a.items()
    if k == "n":
        if v not in env:
            raise GraphFileError(f"node {v!r} is used before it is defined")
        return env[v]
    if k == "float":
        return float(v)
    if k == "tuple":
        return tuple(_dec(x, env) for x in v)
    if k == "dict":
        if not isinstance(v, dict):
            raise GraphFileError(f"malformed dict value {_short(v)}")
        return {kk: _dec(vv, env) for kk, vv in v.items()}
    if k == "dtype":
        return _dtype(v)
    if k == "device":
        return torch.device(v)
    if k in ("layout", "memory_format"):
        val = getattr(torch, v, None) if is_ident(v) else None
        if not isinstance(val, torch.layout if k == "layout" else torch.memory_format):
            raise GraphFileError(f"unknown {k} {_short(v)}")
        return val
    if k == "slice":
        return slice(*(_dec(x, env) for x in v))
    if k == "target":
        return _dec_target(v)
    if k == "ellipsis":
        return Ellipsis
    raise GraphFileError(f"unknown value encoding {k!r}")


def _size(s) -> int:
    if isinstance(s, int):
        return s
    hint = getattr(getattr(s, "node", None), "hint", None)
    if hint is None:
        raise GraphFileError(f"symbolic size {s} has no example value to save")
    return int(hint)


def _enc_val(v) -> Any:
    if isinstance(v, torch.Tensor):
        return {"t": [[_size(s) for s in v.shape], [_size(s) for s in v.stride()],
                      str(v.dtype).removeprefix("torch."), str(v.device)]}
    if isinstance(v, (list, tuple)):
        return [_enc_val(x) for x in v]
    if v is None or isinstance(v, (bool, int)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, torch.SymInt):
        return _size(v)
    return None


def _dec_val(v, mode) -> Any:
    if isinstance(v, dict) and "t" in v:
        shape, stride, dt, dev = v["t"]
        with mode:
            return torch.empty_strided(shape, stride, dtype=_dtype(dt), device=torch.device(dev))
    if isinstance(v, list):
        return tuple(_dec_val(x, mode) for x in v)
    return v


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=True)


# ---------------------------------------------------------------------------------------- save
def save_json(graph: Graph, path: str | pathlib.Path, meta: dict | None = None, inputs: list | None = None,
              constants: dict | None = None) -> list[pathlib.Path]:
    """Write `graph` as `path` (.json) and, given `inputs`, `<stem>.inputs.pt`. Returns the files."""
    path = pathlib.Path(path)
    nodes = []
    traces: dict[str, int] = {}  # one copy of each source stack (many ATen nodes share one line)
    for n in graph.nodes:
        if n.op in ("call_module", "call_method"):
            raise GraphFileError(f"cannot save node {n.name}: {n.op} nodes are not supported (ATen graphs only)")
        d = {"name": n.name, "op": n.op,
             "target": n.target if n.op in ("placeholder", "get_attr", "output") else _enc_target(n.target),
             "args": _enc(tuple(n.args)), "kwargs": _enc(dict(n.kwargs))}
        if "val" in n.meta:
            d["val"] = _enc_val(n.meta["val"])
        if n.meta.get("stack_trace"):
            d["stack_trace"] = traces.setdefault(n.meta["stack_trace"], len(traces))
        if n.meta.get("nn_module_stack"):
            d["nn_module_stack"] = {k: [v[0], getattr(v[1], "__qualname__", str(v[1]))]
                                    for k, v in n.meta["nn_module_stack"].items()}
        for k in ("desc", "k3c_input"):
            if k in n.meta:
                d[k] = str(n.meta[k])
        nodes.append(d)
    doc = {"format": FORMAT, "version": VERSION, "torch": torch.__version__, **(meta or {}),
           "stack_traces": list(traces), "nodes": nodes}
    path.write_text(json.dumps(doc, indent=None, separators=(",", ":")))
    files = [path]
    if inputs is not None:
        ip = inputs_path(path)
        torch.save({"args": [t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in inputs],
                    "constants": {k: v.detach().cpu() for k, v in (constants or {}).items()}}, ip)
        files.append(ip)
    return files


def inputs_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.stem + ".inputs.pt")


# ---------------------------------------------------------------------------------------- load
def load(path: str | pathlib.Path, trust_code: bool = False, sym: dict[str, int] | None = None) -> LoadedGraph:
    path = pathlib.Path(path)
    if path.is_dir():
        cand = path / "graph.json"
        if not cand.exists():
            raise GraphFileError(f"{path} is a directory without graph.json (give a .json, .pt2 or .py graph file)")
        path = cand
    if not path.exists():
        raise GraphFileError(f"{path}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            return _load_json(path)
        if suffix == ".pt2":
            if not trust_code:
                check_pt2(path)
            return _load_pt2(path)
        if suffix == ".py":
            return _load_python(path, trust_code, sym or {})
    except GraphFileError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read is one line for the user
        raise GraphFileError(f"{path}: cannot load as a {suffix} graph: {type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
    raise GraphFileError(f"{path}: unknown graph format {suffix!r} (expected .json from `k3c run --dump`, "
                         f"a torch.export .pt2, or a readable .py graph with --trust-code)")


def _load_json(path: pathlib.Path) -> LoadedGraph:
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GraphFileError(f"{path}: not a JSON graph ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise GraphFileError(f"{path}: not a k3c graph (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise GraphFileError(f"{path}: k3c graph version {doc.get('version')} (this k3c reads {VERSION})")
    nodes, traces = doc.get("nodes"), doc.get("stack_traces", [])
    if not isinstance(nodes, list) or not isinstance(traces, list) or not all(isinstance(t, str) for t in traces):
        raise GraphFileError(f"{path}: malformed k3c graph (\"nodes\" and \"stack_traces\" must be lists)")
    for d in nodes:  # the whole file is checked before FX generates (and executes) any code from it
        _check_node(d, len(traces))
    if any("\r" in t for t in traces):  # Python reads a carriage return as a line break; FX copies traces into comments
        raise GraphFileError(f"{path}: a stack trace holds a carriage return")
    mode = _fake_mode()
    g = Graph()
    env: dict[str, Node] = {}
    for d in nodes:
        op = d["op"]
        target = d["target"] if op in ("placeholder", "get_attr", "output") else _dec_target(d["target"])
        args, kwargs = _dec(d["args"], env), _dec(d["kwargs"], env)
        if op == "output":
            g.output(args[0])
            continue
        n = g.create_node(op, target, args, kwargs, name=d["name"])
        if n.name != d["name"]:
            raise GraphFileError(f"duplicate node name {d['name']!r}")
        if "val" in d:
            n.meta["val"] = _dec_val(d["val"], mode)
        if "stack_trace" in d:
            n.meta["stack_trace"] = traces[d["stack_trace"]]
        if "nn_module_stack" in d:
            n.meta["nn_module_stack"] = {k: tuple(v) for k, v in d["nn_module_stack"].items()}
        for k in ("desc", "k3c_input"):
            if k in d:
                n.meta[k] = d[k]
        env[n.name] = n
    inputs, constants = None, {}
    ip = inputs_path(path)
    notes = []
    if ip.exists():
        try:
            saved = torch.load(ip, weights_only=True)
            inputs, constants = saved["args"], saved.get("constants", {})
        except Exception as e:  # noqa: BLE001
            notes.append(f"{ip.name} unreadable ({type(e).__name__}): numerics not checked")
    root = torch.nn.Module()
    for n in g.nodes:
        if n.op == "get_attr":
            if n.target not in constants:
                raise GraphFileError(f"{path}: the graph reads constant {n.target!r}, which was not saved")
            _set_attr(root, n.target, constants[n.target])
    gm = GraphModule(root, g)
    meta = {k: v for k, v in doc.items() if k not in ("nodes", "stack_traces")}
    return LoadedGraph(gm, "k3c json", inputs, meta.get("user_outputs"), meta.get("groups", {}), meta, notes)


_NODE_OPS = ("placeholder", "get_attr", "call_function", "output")


def _check_node(d, n_traces: int) -> None:
    """One line for the first field of a saved node that could reach the code FX generates, or that
    is not what `save_json` writes: names and targets are identifiers, call targets are checked by
    `_dec_target` (allow-listed op namespaces), keyword names are identifiers."""
    if not isinstance(d, dict):
        raise GraphFileError(f"malformed node {_short(d)}")
    name, op, target = d.get("name"), d.get("op"), d.get("target")
    if op not in _NODE_OPS:
        raise GraphFileError(f"node {_short(name)}: op {_short(op)} is not one of {', '.join(_NODE_OPS)}")
    if op == "output":
        if target != "output":
            raise GraphFileError(f"output node: target {_short(target)} is not 'output'")
    elif not is_ident(name):
        raise GraphFileError(f"node name {_short(name)} is not a Python identifier")
    if op == "placeholder" and not is_ident(target):
        raise GraphFileError(f"placeholder {name}: target {_short(target)} is not a Python identifier")
    if op == "get_attr" and not _dotted(target):
        raise GraphFileError(f"get_attr {name}: target {_short(target)} is not a dotted Python name")
    if op == "call_function":
        _dec_target(target)
    kwargs = d.get("kwargs")
    if not (isinstance(kwargs, dict) and set(kwargs) == {"dict"} and isinstance(kwargs["dict"], dict)):
        raise GraphFileError(f"node {_short(name)}: malformed kwargs {_short(kwargs)}")
    bad = [k for k in kwargs["dict"] if not is_ident(k)]
    if bad:
        raise GraphFileError(f"node {_short(name)}: keyword {_short(bad[0])} is not a Python identifier")
    args = d.get("args")
    if not (isinstance(args, dict) and set(args) == {"tuple"} and isinstance(args["tuple"], list)):
        raise GraphFileError(f"node {_short(name)}: malformed args {_short(args)}")
    st = d.get("stack_trace", 0)
    if not (isinstance(st, int) and not isinstance(st, bool) and 0 <= st < max(n_traces, 1)):
        raise GraphFileError(f"node {_short(name)}: stack_trace {_short(st)} is not an index into stack_traces")
    nms = d.get("nn_module_stack", {})
    if not (isinstance(nms, dict) and all(isinstance(k, str) and isinstance(v, list) and len(v) == 2
                                          and all(isinstance(x, str) for x in v) for k, v in nms.items())):
        raise GraphFileError(f"node {_short(name)}: malformed nn_module_stack")
    for k in ("desc", "k3c_input"):
        if not isinstance(d.get(k, ""), str):
            raise GraphFileError(f"node {_short(name)}: {k} must be a string")


def _set_attr(root: torch.nn.Module, target: str, value) -> None:
    *mods, last = target.split(".")
    m = root
    for p in mods:
        if not hasattr(m, p):
            m.add_module(p, torch.nn.Module())
        m = getattr(m, p)
    setattr(m, last, value)


# Names the torch.export deserializer resolves through sympy (`expr_str`): its own functions and
# sympy's, and symbols such as s0, u3, ps1. Anything else (builtins, dunders) would be evaluated.
_SYM_FUNCS = frozenset({
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt",
    "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal",
    "ToFloat", "FloatTrueDiv", "OpaqueUnaryFn_sqrt", "Identity", "Max", "Min", "Abs", "floor", "ceiling",
    "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Piecewise", "True", "False", "oo", "zoo", "nan"})
_SYM_EXPR = re.compile(r"[A-Za-z0-9_\s+\-*/%().,<>=!&|~]*")
_PT2_TARGET = re.compile(r"torch\.ops\.(?P<ns>\w+)\.\w+\.\w+|torch\.ops\.higher_order\.\w+")


def _safe_sym_expr(e) -> bool:
    return (isinstance(e, str) and _SYM_EXPR.fullmatch(e) is not None and "__" not in e
            and all(t in _SYM_FUNCS or re.fullmatch(r"[a-z]{1,4}\d+", t)
                    for t in re.findall(r"[A-Za-z_]\w*", e)))


def check_pt2(path: pathlib.Path) -> None:
    """Refuse (one line) a .pt2 whose loading could run code: `torch.export.load` unpickles weights
    and constants saved with pickle (`weights_only=False`), falls back to a full unpickle when the
    sample inputs are not plain tensors, loads AOTInductor / ExecuTorch binaries, resolves node
    targets as Python attribute paths and parses symbolic sizes with sympy. Nothing here unpickles
    beyond `torch.load(weights_only=True)` of the sample inputs."""
    import io

    def refuse(why: str):
        raise UntrustedCodeError(f"{path}: {why}; loading it could run code. If you trust the file, pass "
                                 f"--trust-code")

    if not zipfile.is_zipfile(path):
        raise GraphFileError(f"{path}: cannot load as a .pt2 graph: not a zip archive (torch.export.save writes one)")
    with zipfile.ZipFile(path) as z:
        files = {}
        for info in z.infolist():
            parts = info.filename.split("/", 1)
            if len(parts) == 2 and parts[1]:
                files[parts[1]] = info.filename  # every member sits under the archive's own top folder
        if files.get("archive_format") is None or z.read(files["archive_format"]).strip() != b"pt2":
            refuse("not a current torch.export archive (older formats are pickles)")
        for name in files:
            if name.startswith(("data/aotinductor/", "data/executorch/")):
                refuse(f"it holds compiled code ({name})")
            if re.fullmatch(r"data/(weights|constants)/[^/]+\.pt", name):
                refuse(f"it holds legacy pickled weights ({name})")
        for name in files:
            if re.fullmatch(r"data/(weights|constants)/[^/]+_config\.json", name):
                cfg = json.loads(z.read(files[name]))
                for fqn, meta in (cfg.get("config") or {}).items() if isinstance(cfg, dict) else ():
                    if meta.get("use_pickle") or not str(meta.get("path_name", "")).startswith(("weight_", "tensor_")):
                        refuse(f"{fqn!r} is stored with pickle ({name})")
            elif re.fullmatch(r"data/sample_inputs/[^/]+\.pt", name):
                try:
                    torch.load(io.BytesIO(z.read(files[name])), weights_only=True)
                except Exception:  # noqa: BLE001 - torch.export.load would retry with a full unpickle
                    refuse(f"its sample inputs are not plain tensors ({name})")
            elif re.fullmatch(r"models/[^/]+\.json", name):
                _check_pt2_program(json.loads(z.read(files[name])), refuse)


def _check_pt2_program(doc, refuse) -> None:
    """Walk the serialized program: every node target an allow-listed op, every name an identifier,
    every symbolic expression made of sympy's functions and size symbols, no carriage return (a line
    break to Python inside the comments FX writes from stack traces)."""
    stack = [doc]
    while stack:
        x = stack.pop()
        if isinstance(x, str) and "\r" in x:
            refuse(f"a string holds a carriage return ({_short(x)})")
        if isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            if isinstance(x.get("target"), str) and "inputs" in x:   # a graph node
                t = x["target"]
                m = _PT2_TARGET.fullmatch(t)
                ok = (t in _PY_FUNCS or (m is not None and (m.group("ns") in OP_NAMESPACES if m.group("ns")
                                                            else t.rsplit(".", 1)[1] in HOPS)))
                if not ok:
                    refuse(f"a node calls {_short(t)}, which is not an op k3c loads")
            if isinstance(x.get("name"), str) and not is_ident(x["name"]):
                refuse(f"name {_short(x['name'])} is not a Python identifier")
            if "expr_str" in x and not _safe_sym_expr(x["expr_str"]):
                refuse(f"symbolic expression {_short(x['expr_str'])} is not a size expression")
            for k, v in x.items():
                if k == "range_constraints" and isinstance(v, dict):
                    bad = [e for e in v if not _safe_sym_expr(e)]
                    if bad:
                        refuse(f"symbolic expression {_short(bad[0])} is not a size expression")
                stack.append(v)


def _load_pt2(path: pathlib.Path) -> LoadedGraph:
    import k3compile.model  # noqa: F401  (k3model ops, in case the program calls them)
    import k3compile.ops  # noqa: F401
    from torch._inductor.decomposition import select_decomp_table
    from torch.export.graph_signature import InputKind, OutputKind

    if not zipfile.is_zipfile(path):   # a .pt2 is a zip archive; torch >= 2.14 logs a traceback for others
        raise ValueError("not a zip archive (torch.export.save writes one)")
    export_log = logging.getLogger("torch.export")
    level = export_log.level
    export_log.setLevel(logging.ERROR)  # torch.export.load logs (WARNING, with a traceback) what it raises
    try:
        with warnings.catch_warnings():  # torch-internal deprecation noise while unpickling
            warnings.simplefilter("ignore", FutureWarning)
            ep = torch.export.load(str(path))
    finally:
        export_log.setLevel(level)
    ep = ep.run_decompositions(select_decomp_table())
    sig = ep.graph_signature
    notes = []
    inputs: list | None = []
    user_args = None
    if getattr(ep, "example_inputs", None) is not None:
        args, kwargs = ep.example_inputs
        user_args = torch.utils._pytree.tree_leaves((args, kwargs))
    else:
        notes.append("the program has no saved example inputs: numerics not checked")
    ui = 0
    for spec in sig.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            if user_args is None or ui >= len(user_args):
                inputs = None
                break
            inputs.append(user_args[ui])
            ui += 1
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            src = ep.state_dict if spec.target in ep.state_dict else ep.constants
            inputs.append(src[spec.target])
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            inputs.append(ep.constants[spec.target])
        else:
            notes.append(f"input kind {spec.kind.name} is not supported: numerics not checked")
            inputs = None
            break
    g = Graph()
    out = g.graph_copy(ep.graph_module.graph, {})
    g.output(out)
    # as Inductor's post-grad `remove_assert_ops` does before the custom pass runs: export's
    # dtype/device asserts (from .to()) are no-ops that would look like extra users of values
    for n in g.find_nodes(op="call_function", target=torch.ops.aten._assert_tensor_metadata.default):
        g.erase_node(n)
    gm = GraphModule(ep.graph_module, g)
    user_outputs = [i for i, s in enumerate(sig.output_specs) if s.kind == OutputKind.USER_OUTPUT]
    return LoadedGraph(gm, "torch.export", inputs, user_outputs, {}, {}, notes)


_ANNOT = re.compile(r"^(?P<dt>[a-z0-9]+)\[(?P<shape>[^\]]*)\](?:\[(?P<stride>[^\]]*)\])?(?P<dev>[a-z]+(?::\d+)?)?$")
_ABBR = {v: k for k, v in torch.fx.graph.dtype_abbrs.items()}
_ABBR["b8"] = torch.bool


def _dim(s: str, sym: dict[str, int], used: dict[str, int]) -> int:
    s = s.strip()
    if re.fullmatch(r"-?\d+", s):
        return int(s)
    # an expression over symbols (s0, 2*s0, s0 + 1): evaluated over the symbols' values only
    names = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", s))
    env = {}
    for name in names:
        env[name] = sym.get(name, DEFAULT_SYM)
        used[name] = env[name]
    if not re.fullmatch(r"[A-Za-z_0-9\s+\-*/()]+", s):
        raise GraphFileError(f"cannot read the size {s!r}")
    return int(eval(s.replace("//", "/").replace("/", "//"), {"__builtins__": {}}, env))  # noqa: S307


def _fake_from_annotation(name: str, ann, sym, used, mode, device: str):
    if not isinstance(ann, str):
        raise GraphFileError(f"input {name!r} has no shape annotation (like \"bf16[2, 64]\")")
    ann = ann.strip()
    m = re.fullmatch(r"Sym\((.+)\)", ann)
    if m:
        return _dim(m.group(1), sym, used)
    m = _ANNOT.match(ann)
    if not m or m.group("dt") not in _ABBR:
        raise GraphFileError(f"input {name!r}: cannot read the annotation {ann!r}")
    shape = [_dim(s, sym, used) for s in m.group("shape").split(",") if s.strip()]
    dev = torch.device(m.group("dev") or device)
    with mode:
        if m.group("stride"):
            stride = [_dim(s, sym, used) for s in m.group("stride").split(",") if s.strip()]
            return torch.empty_strided(shape, stride, dtype=_ABBR[m.group("dt")], device=dev)
        return torch.empty(shape, dtype=_ABBR[m.group("dt")], device=dev)


def _load_python(path: pathlib.Path, trust_code: bool, sym: dict[str, int]) -> LoadedGraph:
    if not trust_code:
        raise UntrustedCodeError(f"{path} is Python: loading it executes its code. If you trust the file, "
                                 f"pass --trust-code (the .json graphs `k3c run --dump` writes load without it)")
    import inspect

    import k3compile.model  # noqa: F401  (ops the graph may call)
    import k3compile.ops  # noqa: F401
    from torch.fx.experimental.proxy_tensor import make_fx

    ns: dict[str, Any] = {"__name__": "k3c_loaded_graph", "__file__": str(path), "torch": torch,
                          "device": torch.device, "inf": math.inf, "nan": math.nan}
    # TORCH_COMPILE_DEBUG's fx_graph_readable.py / fx_graph_transformed.py name the class `<lambda>`
    src = re.sub(r"^class <[^>]*>\(", "class GraphModule(", path.read_text(), flags=re.M)
    exec(compile(src, str(path), "exec", dont_inherit=True), ns)  # noqa: S102 - --trust-code given
    classes = [v for v in ns.values() if isinstance(v, type) and issubclass(v, torch.nn.Module)
               and v.__module__ == ns["__name__"]]
    cls = ns.get("Repro") if isinstance(ns.get("Repro"), type) else None
    cls = cls or next((c for c in classes if c.__name__ == "GraphModule"), None) or (classes[0] if classes else None)
    if cls is None:
        raise GraphFileError(f"{path}: no nn.Module class (GraphModule / Repro) in the file")
    mod = cls()
    mode = _fake_mode()
    used: dict[str, int] = {}
    notes = []
    if callable(ns.get("load_args")):
        args = _args_from_load_args(ns["load_args"], mode)
    else:
        params = list(inspect.signature(mod.forward).parameters.values())
        args = [_fake_from_annotation(p.name, p.annotation, sym, used, mode, "cpu") for p in params]
    if used:
        notes.append("symbolic sizes set to " + ", ".join(f"{k}={v}" for k, v in sorted(used.items()))
                     + " (change with --sym NAME=N)")
    with mode:
        gm = make_fx(mod, tracing_mode="real", pre_dispatch=False)(*args)
    return LoadedGraph(gm, "python", None, None, {}, {}, notes + ["readable .py graph: numerics not checked "
                                                                  "(no saved inputs)"])


def _args_from_load_args(load_args, mode) -> list:
    """TORCH_COMPILE_DEBUG's fx_graph_runnable.py: `load_args(reader)` names each input's shape."""
    args: list = []

    class Reader:
        def storage(self, storage_hash, nbytes, *, device=None, dtype_hint=None):
            return (nbytes, device, dtype_hint)

        def tensor(self, storage, shape, stride=None, *, storage_offset=0, dtype=None, requires_grad=False,
                   is_leaf=False, **kw):
            _, device, hint = storage
            dt = dtype or hint or torch.float32
            with mode:
                t = (torch.empty_strided(shape, stride, dtype=dt, device=device or "cpu") if stride is not None
                     else torch.empty(shape, dtype=dt, device=device or "cpu"))
            args.append(t)
            return t

        def symint(self, val):
            args.append(val)
            return val

    load_args(Reader())
    return args
