"""Graph-editing helpers the passes share."""
from __future__ import annotations

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_aggregate

from ..patterns.graph import aten, dtype, prims, shape, val


_PROVENANCE = ("nn_module_stack", "stack_trace")


def inherit(new: Node, src: Node) -> Node:
    """Give a new node the module path and source line of the node it sits at (for reports,
    the CLI's per-layer pictures and tlparse), as Inductor's pattern replacements do."""
    for k in _PROVENANCE:
        if k in src.meta and k not in new.meta:
            new.meta[k] = src.meta[k]
    return new


# a KDA decode core in each form the passes leave it: the model's op, fold_kda_gate's, fold_kda_fb's
KDA_DECODE_CORES = ("k3model::kda_decode", "k3::kda_decode_gated", "k3::kda_decode_fb")


def kda_decode_cores(nodes) -> list:
    """The KDA decode cores among `nodes` (one per KDA layer's decode step; KDA_DECODE_CORES)."""
    from ..patterns.structure import op_name
    return [n for n in nodes if op_name(n) in KDA_DECODE_CORES]


def retarget_functionalized(node: Node, op, kwargs: dict) -> None:
    """Make an auto_functionalized node call `op` with `kwargs` (the mutated bases' keywords kept by
    the caller), and pair Inductor's record of its eager inputs with the new arguments (Inductor's
    decomposition of the node reads `eager_input_vals`)."""
    node.args = (op, *node.args[1:])
    node.kwargs = kwargs
    if "eager_input_vals" in node.meta:
        fake = (lambda a: a.meta.get("val") if isinstance(a, Node) else a)  # noqa: E731
        node.meta["eager_input_vals"] = (tuple(map_aggregate(node.args, fake)), dict(map_aggregate(node.kwargs, fake)))


def emit(graph: Graph, after: Node, op, args: tuple) -> Node:
    """Insert `op(*args)` right after `after`; meta['val'] comes from running the op's fake
    implementation on the arguments' fake values."""
    from contextlib import nullcontext

    from torch._guards import detect_fake_mode

    with graph.inserting_after(after):
        n = graph.call_function(op, args)
    inherit(n, after)
    fv = lambda a: val(a) if isinstance(a, Node) else ([fv(x) for x in a] if isinstance(a, (list, tuple)) else a)  # noqa: E731
    fargs = [fv(a) for a in args]
    flat = [t for a in fargs for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
    with (detect_fake_mode(flat) or nullcontext()):
        n.meta["val"] = op(*fargs)
    return n


def emit_functionalized(graph: Graph, after: Node, op, kwargs: dict, bases: dict, v2: bool = True) -> Node:
    """Insert `auto_functionalized_v2(op, **kwargs)` right after `after`, each mutated argument
    (`bases`: argument name -> the graph input it mutates, whole) given as its own base: what AOT
    traces for a call of a mutating custom op, and what Inductor's reinplacing turns back into the
    in-place call where the base is a graph input written back and read by nothing after. Outputs:
    the op's outputs, then the new value of each base in `bases`' order. v2=False: the first form,
    `auto_functionalized(op, **kwargs, **bases)` (what the graph holds where Inductor's
    enable_auto_functionalized_v2 is off, as vLLM sets it), same outputs for whole-tensor bases.
    meta['val'] from the op's fake implementation, meta['eager_input_vals'] as AOT records it."""
    from contextlib import nullcontext

    from torch._guards import detect_fake_mode
    kw = dict(kwargs)
    if v2:
        hop = torch.ops.higher_order.auto_functionalized_v2
        for i, name in enumerate(bases):
            kw[f"_{name}_base_index"] = i
        kw["_all_bases"] = list(bases.values())
    else:
        hop = torch.ops.higher_order.auto_functionalized
        kw.update(bases)
    with graph.inserting_after(after):
        n = graph.call_function(hop, (op,), kw)
    inherit(n, after)
    fake = (lambda a: a.meta.get("val") if isinstance(a, Node) else a)  # noqa: E731
    fkw = dict(map_aggregate(kw, fake))
    flat = [t for t in torch.utils._pytree.tree_leaves(fkw) if isinstance(t, torch.Tensor)]
    with (detect_fake_mode(flat) or nullcontext()):
        n.meta["val"] = hop(op, **fkw)
    n.meta["eager_input_vals"] = ((op,), fkw)
    return n


def getitem(graph: Graph, n: Node, i: int) -> Node:
    import operator
    with graph.inserting_after(n):
        g = graph.call_function(operator.getitem, (n, i))
    g.meta["val"] = n.meta["val"][i]
    return inherit(g, n)


def like(graph: Graph, new: Node, old: Node) -> Node:
    """`new` viewed/cast to `old`'s shape and dtype (inserted right after `new`)."""
    out = new
    if shape(old) is not None and shape(new) != shape(old):
        with graph.inserting_after(out):
            out = inherit(graph.call_function(aten.view.default, (out, list(val(old).shape))), new)
        out.meta["val"] = val(old)
    if dtype(old) is not None and dtype(out) != dtype(old):
        with graph.inserting_after(out):
            out = inherit(graph.call_function(prims.convert_element_type.default, (out, dtype(old))), new)
        out.meta["val"] = val(old)
    return out


def replace(graph: Graph, old: Node, new: Node) -> None:
    old.replace_all_uses_with(like(graph, new, old))


def last_of(graph: Graph, nodes) -> Node:
    """The latest of `nodes` in graph order (FX keeps a sort key per node; an index of the whole
    graph per call was 0.7 s of a 93-layer compile)."""
    nodes = [n for n in nodes if isinstance(n, Node)]
    if all(hasattr(n, "_sort_key") for n in nodes):
        return max(nodes, key=lambda n: n._sort_key)
    order = {n: i for i, n in enumerate(graph.nodes)}
    return max(nodes, key=lambda n: order[n])


def forward_gemm(start: Node, limit: int = 500) -> Node | None:
    """The first mm/addmm reached from `start` following users (breadth first)."""
    seen, frontier = {start}, [start]
    while frontier and len(seen) < limit:
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                if u.op == "call_function" and u.target in (aten.mm.default, aten.addmm.default):
                    return u
                seen.add(u)
                nxt.append(u)
        frontier = nxt
    return None


def users_through_views(n: Node) -> list[Node]:
    from ..patterns.graph import VIEW_OPS
    out = []
    for u in n.users:
        if u.op == "call_function" and u.target in VIEW_OPS:
            out.extend(users_through_views(u))
        else:
            out.append(u)
    return out

