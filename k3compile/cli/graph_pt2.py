"""`.pt2` graph files (`torch.export` archives): the check that refuses an archive whose loading could
run code (`check_pt2`, before anything is unpickled), and the load into the ATen forms the passes see
(`load_pt2`: decomposed with Inductor's decomposition table, weights and saved example inputs kept to
check numerics)."""
from __future__ import annotations

import json
import logging
import pathlib
import re
import warnings
import zipfile

import torch
from torch.fx import Graph, GraphModule

from .graphfile import HOPS, OP_NAMESPACES, PY_FUNCS, GraphFileError, LoadedGraph, UntrustedCodeError, is_ident, short

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
            refuse(f"a string holds a carriage return ({short(x)})")
        if isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            if isinstance(x.get("target"), str) and "inputs" in x:   # a graph node
                t = x["target"]
                m = _PT2_TARGET.fullmatch(t)
                ok = (t in PY_FUNCS or (m is not None and (m.group("ns") in OP_NAMESPACES if m.group("ns")
                                                            else t.rsplit(".", 1)[1] in HOPS)))
                if not ok:
                    refuse(f"a node calls {short(t)}, which is not an op k3c loads")
            if isinstance(x.get("name"), str) and not is_ident(x["name"]):
                refuse(f"name {short(x['name'])} is not a Python identifier")
            if "expr_str" in x and not _safe_sym_expr(x["expr_str"]):
                refuse(f"symbolic expression {short(x['expr_str'])} is not a size expression")
            for k, v in x.items():
                if k == "range_constraints" and isinstance(v, dict):
                    bad = [e for e in v if not _safe_sym_expr(e)]
                    if bad:
                        refuse(f"symbolic expression {short(bad[0])} is not a size expression")
                stack.append(v)


def load_pt2(path: pathlib.Path) -> LoadedGraph:
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
