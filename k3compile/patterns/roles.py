"""A K3 decoder's layers found by role, from the graph's own shape (no op names needed).

The residual stream is the chain of `[M, hidden]` adds where each add's one operand is the previous
add (or the embedding, or a graph input when one layer is traced): `updated = prefix + delta`, in
any operand order, `torch.add` or an in-place `add_` (functionalised to `add`), through views and
dtype casts. Each add's delta is what one sub-layer computed; walking back from it, no further than
the previous add, classifies it:
- "moe": a top-k (the router's selection) lies in the region, or an opaque MoE op that holds it
  (`OPAQUE_MOE_OPS`: vLLM's `moe_forward_shared`, whose router logits and latent input are computed
  outside it and whose two outputs, the shared and the routed partial, meet in the latent tail after it);
- "mlp": the delta is a GEMM (through its all-reduce) of an element-wise function of GEMMs that all
  read one input (the dense SiTU MLP: gate/up GEMM(s), SiTU, down GEMM);
- "attention": any other GEMM-ended delta, or one whose region holds one of vLLM's attention cores
  (`VLLM_ATTENTION_OPS`, checked before the dense-MLP test); that GEMM is the layer's o-proj. Any other
  core (a custom op, einsum/bmm, a recurrence on a state tensor) is not recognised and need not be.
A decoder layer is an attention delta followed by an mlp / moe delta; expected site counts derive
from these (patterns/structure.py).
"""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, Node

from .graph import CONVERT_OPS, VIEW_OPS, aten, c10d, is_call, is_weight_like, shape, strip

GEMMS = (aten.mm.default, aten.addmm.default)

# Opaque ops that take a role, by `ns::name`. A stream op's output 0 is the updated residual:
# (argument index of the prefix, of the delta, the delta's kind or None to classify it)
STREAM_OPS = {"k3::oproj_allreduce_residual": (2, 0, "attention"), "k3::residual_norm": (1, 0, None)}
# set on a Graph by the canonicalisation of vLLM's AttnRes kernel (its prefix restarts at a block write)
RESET_MARK = "_k3_attn_res_prefix_resets"
# vLLM's opaque MoE ops (router top-k, experts, finalize and the shared expert inside; two outputs)
OPAQUE_MOE_OPS = {"vllm::moe_forward_shared", "vllm::moe_forward"}
# vLLM's Kimi K3 attention cores, one op per layer: the KDA decode step (`_C::fused_kda_decode`) and the MLA
# core, which vLLM runs as Python and K3's vLLM hook makes one op for Dynamo (integrations/vllm.py)
VLLM_ATTENTION_OPS = {"_C::fused_kda_decode", "k3vllm::kimi_k3_mla_attention"}
# ops whose output 0 is the router's expert ids (what aten.topk's output 1 is)
TOPK_OPS = {"k3::router_topk"}


_AUTO_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized,
                        getattr(torch.ops.higher_order, "auto_functionalized_v2", None))
_NAMES: dict = {}   # op overload -> "ns::name" (called for every node, every pass: cached)


def op_name(n: Any) -> str | None:
    """`ns::name` of the op a node calls (through auto_functionalized), or None."""
    if not isinstance(n, Node) or n.op != "call_function":
        return None
    t = n.target
    if t in _AUTO_FUNCTIONALIZED:
        t = n.args[0]
    try:
        return _NAMES[t]
    except (KeyError, TypeError):
        pass
    name = getattr(t, "name", None)
    out = name().split(".")[0] if callable(name) and isinstance(t, torch._ops.OpOverload) else None
    try:
        _NAMES[t] = out
    except TypeError:
        pass
    return out


def is_topk(n: Any) -> bool:
    return is_call(n, aten.topk.default) or op_name(n) in TOPK_OPS
# element-wise (and shape-only) ops a dense MLP's activation is made of, between its GEMMs
_ELEMENTWISE = {
    aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.tanh.default,
    aten.sigmoid.default, aten.silu.default, aten.exp.default, aten.reciprocal.default, aten.gelu.default,
    aten.relu.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    aten.select.int, aten.expand.default, aten.permute.default, aten.t.default, aten.transpose.int,
    operator.getitem, *VIEW_OPS, *CONVERT_OPS}


@dataclass
class ResidualAdd:
    add: Node                  # updated = prefix + delta
    prefix: Node
    delta: Node
    kind: str = "unknown"      # "attention" | "mlp" | "moe" | "input" (delta a graph input) | "unknown"
    gemm: Node | None = None   # attention: the o-proj GEMM; mlp: the down-projection GEMM
    topk: Node | None = None   # moe: the router's top-k
    op: Node | None = None     # moe: the opaque MoE op (OPAQUE_MOE_OPS) holding the top-k, experts and finalize
    why: str | None = None     # kind "unknown": why no role fits

    @property
    def name(self) -> str:   # how reports name the site: its add (a router outside the stream: its top-k)
        return self.add.name if self.add is not None else (self.topk or self.op).name


@dataclass
class Layer:
    attention: ResidualAdd
    ffn: ResidualAdd | None = None   # None: the graph ends after this layer's attention

    @property
    def moe(self) -> bool:
        return self.ffn is not None and self.ffn.kind == "moe"


def _base(n: Any) -> Any:
    return strip(n, converts=True)


def _tensor2(n: Any) -> bool:
    s = shape(n)
    return s is not None and len(s) >= 2


def is_embedding(n: Any) -> bool:
    """A row lookup in a weight table: `F.embedding`, `W[ids]` or `index_select(W, 0, ids)`."""
    if is_call(n, aten.embedding.default):
        return True
    return (is_call(n, aten.index.Tensor, aten.index_select.default) and is_weight_like(n.args[0])
            and len(shape(n.args[0]) or ()) == 2 and (n.target is aten.index.Tensor or n.args[1] == 0))


def hidden_width(graph: Graph) -> int | None:
    """The model width: the embedding's output width, else the most common width of [M, w] adds."""
    for n in graph.nodes:
        if is_embedding(n) and shape(n):
            return shape(n)[-1]
    widths = Counter(shape(n)[-1] for n in graph.nodes if is_call(n, aten.add.Tensor) and _tensor2(n)
                     and all(isinstance(a, Node) for a in n.args[:2]))
    return widths.most_common(1)[0][0] if widths else None


def residual_stream(graph: Graph) -> list[ResidualAdd]:
    """The residual adds in stream order (the longest chain, when the graph holds several). In a graph
    whose vLLM AttnRes kernels were canonicalised (marked `RESET_MARK`) and where no chain starts at the
    embedding or a graph input: the chain that starts at a sub-layer's output (`_reset_prefix`)."""
    stream = _residual_stream(graph, reset=False)
    if not stream and getattr(graph, RESET_MARK, False):
        stream = _residual_stream(graph, reset=True)
    return stream


def _residual_stream(graph: Graph, reset: bool) -> list[ResidualAdd]:
    h = hidden_width(graph)
    if h is None:
        return []
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    starts = {_base(n) for n in nodes if is_embedding(n)}
    chain_of: dict[Node, list[ResidualAdd]] = {}
    chains: list[list[ResidualAdd]] = []
    for n in nodes:
        kind = None
        if op_name(n) in STREAM_OPS:   # a fused op: its output 0 (if used) is the updated residual
            pi, di, kind = STREAM_OPS[op_name(n)]
            a, b = n.args[pi], n.args[di]
        elif is_call(n, aten.add.Tensor) and _tensor2(n) and shape(n)[-1] == h and len(n.args) >= 2:
            a, b = n.args[:2]
            if not (isinstance(a, Node) and isinstance(b, Node) and shape(a) == shape(b) == shape(n)):
                continue
        else:
            continue
        link = next(((p, d) for p, d in ((a, b), (b, a)) if _base(p) in chain_of), None)
        if link is not None:
            prefix, delta = link
            chain = chain_of[_base(prefix)]
            if _base(prefix) not in _outputs(chain[-1].add):
                continue   # a second add on an old stream value (not a residual step)
        else:
            link = next(((p, d) for p, d in ((a, b), (b, a)) if _base(p) in starts), None)
            if link is None:
                link = next(((p, d) for p, d in ((a, b), (b, a)) if _base(p).op == "placeholder"
                             and not is_weight_like(d) and _base(d).op != "placeholder"), None)
            if link is None and all(_base(x).op == "placeholder" for x in (a, b)):
                link, kind = (a, b), "input"   # one layer traced: prefix + delta, both graph inputs
            if link is None and reset and not chains:
                link = _reset_prefix(n, a, b)
            if link is None:
                continue
            prefix, delta = link
            chain = []
            chains.append(chain)
        chain.append(ResidualAdd(add=n, prefix=prefix, delta=delta, kind=kind or "unknown"))
        for o in _outputs(n):
            chain_of[o] = chain
    if not chains:
        return []
    stream = max(chains, key=len)
    for r in stream:
        dims = shape(r.prefix) or ()
        if len(dims) != 2 and r.kind == "unknown":
            r.why = f"the residual stream is {len(dims)}-D {list(dims)}: the fused ops take [M, hidden]"
        elif r.kind == "unknown":
            _classify(r, pos.get(_base(r.prefix), 0), pos)
        elif r.kind == "attention":
            r.gemm = r.add.args[0]   # an o-proj already fused: its op
    return stream


def _reset_prefix(add: Node, a: Node, b: Node) -> tuple[Node, Node] | None:
    """A stream that starts at a sub-layer's output rather than at the embedding: vLLM's Kimi K3 writes
    the running prefix as an AttnRes block and restarts it from the attention output (layer 0), so the
    first residual add is `attn_out + mlp_out`. The prefix is the operand something else reads too
    (the mixer after it), the delta the one only this add reads; both computed (no weight, no input)."""
    pa, pb = _base(a), _base(b)
    if any(x.op == "placeholder" or is_weight_like(x) for x in (pa, pb)):
        return None
    others = [len([u for u in x.users if u is not add]) > 0 for x in (a, b)]
    if others == [True, False]:
        return a, b
    if others == [False, True]:
        return b, a
    return None


def _outputs(n: Node) -> list[Node]:
    """The nodes holding an add's result: the add, or a fused op and its output 0."""
    if op_name(n) in STREAM_OPS:
        return [n] + [u for u in n.users if is_call(u, operator.getitem) and u.args[1] == 0]
    return [n]


def layers(stream: list[ResidualAdd]) -> list[Layer]:
    """Pair each attention delta with the mlp / moe delta after it."""
    out: list[Layer] = []
    for r in stream:
        if r.kind == "attention":
            out.append(Layer(attention=r))
        elif r.kind in ("mlp", "moe") and out and out[-1].ffn is None:
            out[-1].ffn = r
    return out


def routers(graph: Graph, stream: list[ResidualAdd]) -> list[ResidualAdd]:
    """The MoE sub-layers: the stream's "moe" adds, then every router top-k outside them (a graph cut
    after the MoE, before its residual add: one layer traced) as a site with no add."""
    out = [r for r in stream if r.kind == "moe"]
    seen = {r.topk for r in out}
    for n in graph.nodes:
        if is_topk(n) and n not in seen and (not is_call(n, aten.topk.default) or _getitem1_used(n)):
            out.append(ResidualAdd(add=None, prefix=None, delta=None, kind="moe", topk=n))
    return out


def _getitem1_used(n: Node) -> bool:
    return any(is_call(u, operator.getitem) and u.args[1] == 1 and u.users for u in n.users)


def delta_gemm(delta: Node) -> Node | None:
    """The GEMM whose output (through views, casts and a functional all-reduce) is `delta`."""
    n = _base(delta)
    if is_call(n, c10d.wait_tensor.default) and is_call(n.args[0], c10d.all_reduce.default):
        n = _base(n.args[0].args[0])
    return n if is_call(n, *GEMMS) else None


def _classify(r: ResidualAdd, lo: int, pos: dict) -> None:
    region = _region(r.delta, lo, pos)
    topks = [n for n in region if is_topk(n)]
    if topks:
        r.kind, r.topk = "moe", topks[-1]
        return
    moes = [n for n in region if op_name(n) in OPAQUE_MOE_OPS]
    if moes:   # before the GEMM test: its up-projection (addmm into the shared partial) ends the delta
        r.kind, r.op = "moe", max(moes, key=lambda n: pos.get(n, -1))
        return
    g = delta_gemm(r.delta)
    if g is None:
        r.kind, r.why = "unknown", f"the delta {r.delta.name} is not a GEMM's output (through an all-reduce)"
        return
    r.gemm = g
    core = any(op_name(n) in VLLM_ATTENTION_OPS for n in region)
    r.kind = "mlp" if not core and _dense_mlp(g) else "attention"


def _region(delta: Node, lo: int, pos: dict, limit: int = 20000) -> list[Node]:
    """The nodes `delta` depends on that come after position `lo` (this sub-layer's own nodes)."""
    seen, stack = {delta}, [delta]
    while stack and len(seen) < limit:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen and pos.get(a, -1) > lo:
                seen.add(a)
                stack.append(a)
    return list(seen)


def _dense_mlp(down: Node) -> bool:
    """`down`'s activation is an element-wise function of GEMMs that all read one input."""
    x = down.args[1] if is_call(down, aten.addmm.default) else down.args[0]
    inputs, seen, stack = set(), set(), [x]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, Node):
            continue
        seen.add(n)
        if is_call(n, *GEMMS):
            inputs.add(_base(n.args[1] if is_call(n, aten.addmm.default) else n.args[0]))
            continue
        if not (is_call(n) and n.target in _ELEMENTWISE):
            return False
        stack.extend(a for a in n.args if isinstance(a, Node))
        if len(seen) > 200:
            return False
    return len(inputs) == 1


def expert_users(topk: Node) -> list[Node]:
    """The nodes that read the top-k's expert ids (through views and casts): an expert op, or the
    index ops of an expert computation written in plain torch."""
    ids = [u for u in topk.users if is_call(u, operator.getitem) and u.args[1] == 1]
    out, stack = [], list(ids)
    while stack:
        n = stack.pop()
        for u in n.users:
            if is_call(u, *VIEW_OPS, *CONVERT_OPS):
                stack.append(u)
            elif not is_call(u, aten.gather.default):   # the router's own gather of its scores
                out.append(u)
    return out


def is_float_tensor(n: Any) -> bool:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return isinstance(v, torch.Tensor) and v.is_floating_point()
