"""What a graph file loads into, and what it may name: the result of loading (`LoadedGraph`), the
one-line errors for a file k3c refuses, and the allow-lists every format's checks share (op
namespaces, the functionalisation HOPs, Python operators, identifiers). `graphio` reads and writes
the formats; `graph_pt2` checks and loads `torch.export` archives."""
from __future__ import annotations

import keyword
import math
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule

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


def dotted(s) -> bool:
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
PY_FUNCS = {f"_operator.{n}": getattr(operator, n) for n in (
    "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
    "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "not_")}
PY_FUNCS.update({f"math.{n}": getattr(math, n) for n in ("ceil", "floor", "sqrt", "trunc")})
PY_FUNCS.update({f"torch.{n}": getattr(torch, n) for n in (
    "sym_max", "sym_min", "sym_float", "sym_int", "sym_not", "sym_ite", "sym_sum") if hasattr(torch, n)})
PY_NAMES = {id(f): k for k, f in PY_FUNCS.items()}


def short(x, n: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= n else r[:n] + "...'"
