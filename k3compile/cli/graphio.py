"""Save and load FX graphs for `k3c run --graph FILE`.

Formats, chosen by file suffix:
- `.json` (written by `k3c run --dump`): the graph as data: every node's op, target (an op name),
  arguments, the shape/stride/dtype/device of its value, its module path and source line. The whole
  file is checked before FX generates code from it (`_check_node`): names, placeholder / get_attr
  targets and keyword names must be Python identifiers, call targets resolve only to ops of
  `graphfile.OP_NAMESPACES`, the functionalisation HOPs and a fixed set of Python operators; nothing from the
  file is executed. The graph's real inputs (weights, cache, token ids), when saved, sit next to it
  in `<stem>.inputs.pt` (tensors only, read with `torch.load(weights_only=True)`).
- `.pt2`: a `torch.export` program (`graph_pt2`). Without `trust_code` the archive is checked first
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
import math
import pathlib
import re
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from .graph_pt2 import check_pt2, load_pt2
from .graphfile import (HOPS, PY_FUNCS, PY_NAMES, GraphFileError, LoadedGraph, UntrustedCodeError,
                        dotted, is_ident, op_qualname, resolve_op, short)

FORMAT = "k3c-graph"
VERSION = 1
DEFAULT_SYM = 8  # value given to a symbolic size in a .py graph when --sym does not name it


def _enc_target(t) -> Any:
    if isinstance(t, torch._ops.OpOverload):
        return {"op": op_qualname(t)}
    if isinstance(t, torch._ops.HigherOrderOperator):
        return {"hop": t.name()}
    if id(t) in PY_NAMES:
        return {"py": PY_NAMES[id(t)]}
    raise GraphFileError(f"cannot save a graph that calls {getattr(t, '__qualname__', t)!r} "
                         f"(only torch ops and Python operators)")


def _dec_target(d):
    if "op" in d:
        return resolve_op(d["op"])
    if not isinstance(d, dict) or len(d) != 1:
        raise GraphFileError(f"a call target must be {{\"op\": ...}}, {{\"hop\": ...}} or {{\"py\": ...}}, got {short(d)}")
    if "op" in d:
        return resolve_op(d["op"])
    if "hop" in d:
        if d["hop"] not in HOPS:
            raise GraphFileError(f"the graph names higher-order op {short(d['hop'])}, which k3c does not load "
                                 f"({', '.join(sorted(HOPS))})")
        try:
            return getattr(torch.ops.higher_order, d["hop"])
        except AttributeError:
            raise GraphFileError(f"unknown higher-order op {d['hop']!r} in this torch version") from None
    if "py" in d and isinstance(d["py"], str) and d["py"] in PY_FUNCS:
        return PY_FUNCS[d["py"]]
    raise GraphFileError(f"the graph names a Python function that k3c does not load: {short(d)}")


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
        raise GraphFileError(f"malformed value {short(a)}")
    if len(a) != 1:
        raise GraphFileError(f"malformed value {short(a)}")
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
            raise GraphFileError(f"malformed dict value {short(v)}")
        return {kk: _dec(vv, env) for kk, vv in v.items()}
    if k == "dtype":
        return _dtype(v)
    if k == "device":
        return torch.device(v)
    if k in ("layout", "memory_format"):
        val = getattr(torch, v, None) if is_ident(v) else None
        if not isinstance(val, torch.layout if k == "layout" else torch.memory_format):
            raise GraphFileError(f"unknown {k} {short(v)}")
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
            return load_pt2(path)
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
        raise GraphFileError(f"malformed node {short(d)}")
    name, op, target = d.get("name"), d.get("op"), d.get("target")
    if op not in _NODE_OPS:
        raise GraphFileError(f"node {short(name)}: op {short(op)} is not one of {', '.join(_NODE_OPS)}")
    if op == "output":
        if target != "output":
            raise GraphFileError(f"output node: target {short(target)} is not 'output'")
    elif not is_ident(name):
        raise GraphFileError(f"node name {short(name)} is not a Python identifier")
    if op == "placeholder" and not is_ident(target):
        raise GraphFileError(f"placeholder {name}: target {short(target)} is not a Python identifier")
    if op == "get_attr" and not dotted(target):
        raise GraphFileError(f"get_attr {name}: target {short(target)} is not a dotted Python name")
    if op == "call_function":
        _dec_target(target)
    kwargs = d.get("kwargs")
    if not (isinstance(kwargs, dict) and set(kwargs) == {"dict"} and isinstance(kwargs["dict"], dict)):
        raise GraphFileError(f"node {short(name)}: malformed kwargs {short(kwargs)}")
    bad = [k for k in kwargs["dict"] if not is_ident(k)]
    if bad:
        raise GraphFileError(f"node {short(name)}: keyword {short(bad[0])} is not a Python identifier")
    args = d.get("args")
    if not (isinstance(args, dict) and set(args) == {"tuple"} and isinstance(args["tuple"], list)):
        raise GraphFileError(f"node {short(name)}: malformed args {short(args)}")
    st = d.get("stack_trace", 0)
    if not (isinstance(st, int) and not isinstance(st, bool) and 0 <= st < max(n_traces, 1)):
        raise GraphFileError(f"node {short(name)}: stack_trace {short(st)} is not an index into stack_traces")
    nms = d.get("nn_module_stack", {})
    if not (isinstance(nms, dict) and all(isinstance(k, str) and isinstance(v, list) and len(v) == 2
                                          and all(isinstance(x, str) for x in v) for k, v in nms.items())):
        raise GraphFileError(f"node {short(name)}: malformed nn_module_stack")
    for k in ("desc", "k3c_input"):
        if not isinstance(d.get(k, ""), str):
            raise GraphFileError(f"node {short(name)}: {k} must be a string")


def _set_attr(root: torch.nn.Module, target: str, value) -> None:
    *mods, last = target.split(".")
    m = root
    for p in mods:
        if not hasattr(m, p):
            m.add_module(p, torch.nn.Module())
        m = getattr(m, p)
    setattr(m, last, value)


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
