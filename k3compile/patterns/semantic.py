"""Match by role, verify by evaluation.

A piece of the graph found by its role (its inputs and outputs are known, its inside is whatever
the model's author wrote) is cut out as a small GraphModule and run on random CPU tensors next to
the math the rewrite will put in its place. Equal within a tight tolerance: the site matches,
however it was spelt (`(y * w[..., None]).sum(1)`, `bmm(w[:, None], y)`, `einsum`; a renormalise
with `/`, or `* (s / ...)`). Different: a near-miss naming the difference.

The region may read graph inputs beyond the named inputs only where they are weight-like
(parameters, buffers): those get random values of their shape too, passed to the reference.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.fx import Graph, GraphModule, Node

from .graph import Fail, concrete, is_weight_like, val

MAX_NODES = 600


def region(outputs: list[Node], inputs: list[Node], max_nodes: int = MAX_NODES) -> tuple[list[Node], list[Node]] | Fail:
    """(the call nodes computing `outputs` from `inputs`, in graph order; the weight-like graph
    inputs they read beyond `inputs`), or a Fail at the first node that is neither."""
    stop = set(inputs)
    seen: set[Node] = set()
    leaves: list[Node] = []
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in stop or n in seen:
            continue
        if n.op in ("placeholder", "get_attr"):
            if not is_weight_like(n):
                return Fail(n, f"the region reads graph input {n.name} beyond its inputs")
            if n not in leaves:
                leaves.append(n)
            continue
        if n.op != "call_function":
            return Fail(n, f"the region holds a {n.op} node")
        seen.add(n)
        if len(seen) > max_nodes:
            return Fail(n, f"the region is over {max_nodes} nodes")
        stack.extend(n.all_input_nodes)
    def key(n):   # graph order (FX keeps a sort key per node)
        return n._sort_key

    return sorted(seen, key=key), sorted(leaves, key=key)


def _cpu(a):
    """An argument as the CPU run takes it: devices -> cpu, symbolic sizes -> their example values
    (read as hints: no guard is added, so a dynamic graph stays dynamic)."""
    if isinstance(a, torch.device):
        return torch.device("cpu")
    if isinstance(a, (torch.SymInt, torch.SymFloat)):
        h = a.node.hint
        return h if h is not None else 4
    if isinstance(a, (list, tuple)):
        return type(a)(_cpu(x) for x in a)
    if isinstance(a, dict):
        return {k: _cpu(v) for k, v in a.items()}
    return a


def module(nodes: list[Node], inputs: list[Node], outputs: list[Node]) -> GraphModule:
    """A GraphModule of `nodes` with placeholders for `inputs` (in order) returning `outputs`."""
    g = Graph()
    env: dict[Node, Node] = {}
    for i, n in enumerate(inputs):
        env[n] = g.placeholder(f"in{i}")
    for n in nodes:
        c = g.node_copy(n, lambda x: env[x])
        c.args, c.kwargs = _cpu(c.args), _cpu(c.kwargs)
        env[n] = c
    g.output(tuple(env[o] for o in outputs))
    return GraphModule(torch.nn.Module(), g)


def random_like(n: Node, gen: torch.Generator, scale: float = 1.0):
    v = val(n)
    if isinstance(v, torch.SymInt):   # a size the region reads (dynamic graphs): its example value
        return concrete(v)
    shape = [concrete(s) or 4 for s in v.shape]
    if v.dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * scale).to(v.dtype)
    if v.dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    return torch.randint(0, 16, shape, generator=gen).to(v.dtype)


def evaluate(outputs: list[Node], inputs: list[Node], make_inputs: Callable[[torch.Generator], list],
             check: Callable, seed: int = 0, leaf_value: Callable | None = None):
    """Run the region computing `outputs` from `inputs` on CPU and return
    `check(outputs' values, inputs' values, {leaf: value})` (run with real tensors too), or a Fail.
    `make_inputs(gen)` gives the values of `inputs`; the weight-like leaves get random values, or
    `leaf_value(leaf, gen)` where that gives one (a Fail from it is returned)."""
    r = region(outputs, inputs)
    if isinstance(r, Fail):
        return r
    nodes, leaves = r
    if any(not isinstance(val(x), (torch.Tensor, torch.SymInt)) for x in (*inputs, *leaves)):
        return Fail(outputs[0], "the region's inputs have no example values")
    gm = module(nodes, inputs + leaves, outputs)
    with _real_tensors(), torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        xs = list(make_inputs(gen))
        ws = []
        for leaf in leaves:
            w = leaf_value(leaf, gen) if leaf_value is not None else None
            if isinstance(w, Fail):
                return w
            ws.append(random_like(leaf, gen, 0.5) if w is None else w)
        try:
            outs = gm(*xs, *ws)
        except Exception as e:  # noqa: BLE001 - a region that does not run is not this site
            return Fail(outputs[0], f"the region does not run on CPU ({type(e).__name__}: {str(e)[:80]})")
        # the weight-like leaves that are tensors (a dynamic graph's size inputs are leaves too)
        return check(outs, xs, {n: w for n, w in zip(leaves, ws) if isinstance(w, torch.Tensor)})


class _real_tensors:
    """No fake (or other) dispatch mode while the region runs: the passes run under the graph's fake
    mode, sometimes more than one deep."""

    def __enter__(self):
        self._modes = []
        while True:
            m = torch._C._unset_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
            if m is None:
                break
            self._modes.append(m)
        self._cm = torch.utils._python_dispatch._disable_current_modes()
        self._cm.__enter__()

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        for m in reversed(self._modes):
            torch._C._set_dispatch_mode(m)


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-3, atol: float = 1e-4) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol)
