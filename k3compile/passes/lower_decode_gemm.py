"""lower_decode_gemm: the decode GEMMs the other passes leave in the graph, onto k3's decode GEMM.

Runs after the other rewrites (only fold_mla_output, which takes the ops it emits, and pair_pdl,
which sets an argument of them, come after it), over what they left: the attention input projections (KDA in_proj and
f_b, MLA qkv_a and q_b), the dense MLP, the LM head, and the MoE GEMMs of any MoE pass that did
not apply. Inductor hands these to cuBLAS, whose kernels read a decode weight at 1.3-3.9 TB/s on
an H200 (the KDA in_proj at TP=8 widths, 90 MB, at 2.4-2.9; bench/gemv_bench.py, BENCHMARKS.md).

Matches, per site: every `mm(x, W^T)` (F.linear without bias; W a 2-D weight, a graph input, in
F.linear's [out, in] layout; x [M, K] of the model dtype, M static <= 16 or dynamic).
Expected: every mm / addmm with a weight-matrix operand still in the graph when the pass runs (not a
1-D parameter viewed as a column: the AttnRes logits GEMV, an mm on a GPU); the ones
it cannot take are near-misses with the reason (an addmm the model wrote, a weight stored [in, out],
another dtype, a weight on the left). The addmm Inductor's post-grad pass folds out of `mm + add` (a
GEMM whose output is added to a tensor that also goes to a non-pointwise op: the o-proj and its
residual at TP=1) is `mm + add` again by then (passes/canonicalize.py): its mm is taken.
Emits: `k3::decode_gemm(x, W)`. On CUDA it runs the tensor-core split-K kernel with the tuned
config where `kernels/tuning.GEMV_TABLE` has this weight shape and M (measured faster than
cuBLAS), else torch.mm: so a shape the table lacks costs nothing but the custom-op call.
Its reference is `x @ W.T`, exact on CPU.
Also every `bmm(x [H, M, K], V)` whose right operand V is a per-head weight W (a 3-D graph input)
reached through views, permutes and copies only, with V equal to W ([H, K, N]) or to
W.transpose(1, 2) (W stored [H, N, K]): the MLA query absorption and value up-projection (einsums
that Inductor hands to cuBLAS's batched GEMM). Which of the two V is, is found by replaying that
chain of views on an index tensor of W's shape. Emits `k3::decode_bmm(x, W, w_nk)`: one Triton
kernel on CUDA (kernels/gemm.head_bmm), reference torch.bmm, exact on CPU. Where the bmm's result, moved
back to [M, H, N] by views only (checked by the same replay), is multiplied by sigmoid(G) and by
nothing else (the MLA output gate), G joins the op, `k3::decode_bmm(x, W, w_nk, G)`, and the
multiply goes: one kernel where Inductor launched a separate gate kernel. The op's result is
stored token-major, so the views back to [M, H, N] and the o-proj's reshape copy nothing.
Skipped: model dtype / TP size not supported, static M outside [1, 16] (one MMA tile of tokens);
on CUDA with Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py).
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..ops import OPS
from ..patterns.graph import Fail, _weight_of, dtype, is_call, is_weight_like, replays_to, shape, strip, val
from .base import K3Pass
from .pipeline import register

aten = torch.ops.aten


_CHAIN_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.dim,
              aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.alias.default,
              aten.clone.default, aten.contiguous.default, aten.permute.default, aten.transpose.int,
              aten.t.default, aten.expand.default}


def _weight_chain(n):
    """(W, [nodes from W's first view to n]) when n is a graph input reached through _CHAIN_OPS only."""
    chain = []
    while is_call(n) and n.target in _CHAIN_OPS:
        chain.append(n)
        n = n.args[0]
    return (n, chain[::-1]) if isinstance(n, torch.fx.Node) and n.op in ("placeholder", "get_attr") else (None, [])


def _bmm_weight(n):
    """bmm(x, V) with V a per-head weight's view: (W, w_nk) or a Fail."""
    w, chain = _weight_chain(n.args[1])
    wv = val(w) if w is not None else None
    if wv is None or wv.dim() != 3:
        return Fail(n, "the right operand is not a view of a 3-D weight")
    if wv.numel() > 1 << 24:
        return Fail(n, f"per-head weight of {wv.numel()} elements: larger than a decode bmm's (not probed)")
    for c in chain:
        if any(isinstance(a, torch.fx.Node) for a in torch.fx.node.map_aggregate((c.args[1:], c.kwargs), lambda a: a)):
            return Fail(c, "a view of the weight with a computed size")
    with unset_fake_temporarily():  # real tensors: the passes run under the graph's fake mode
        probe = torch.arange(wv.numel(), dtype=torch.float64).view(tuple(wv.shape))
        v = probe
        try:
            for c in chain:
                v = c.target(v, *c.args[1:], **c.kwargs)
        except Exception as e:  # noqa: BLE001 - a view this replay cannot follow is a near-miss, not a crash
            return Fail(n, f"cannot follow the weight's views ({type(e).__name__})")
        same, tr = (v.shape == probe.shape and torch.equal(v, probe),
                    v.shape == probe.transpose(1, 2).shape and torch.equal(v, probe.transpose(1, 2)))
    if same:
        return w, False
    if tr:
        return w, True
    return Fail(n, "the per-head weight is neither [H, K, N] nor the transpose of [H, N, K]")


def _gate_of(bmm, order):
    """(mul, G, end): the bmm's result moved to [M, H, N] by a single-user chain of views ending at
    `end`, then mul(end, sigmoid(G)) with G [M, H, N] computed before the bmm; else None."""
    chain, n = [], bmm
    while len(n.users) == 1 and is_call(next(iter(n.users)), *_CHAIN_OPS) and next(iter(n.users)).args[0] is n:
        n = next(iter(n.users))
        chain.append(n)
    if not chain or len(n.users) != 1:
        return None
    mul = next(iter(n.users))
    if not is_call(mul, aten.mul.Tensor) or len(mul.args) != 2:
        return None
    sig = mul.args[1] if mul.args[0] is n else mul.args[0]
    if not is_call(sig, aten.sigmoid.default) or not isinstance(sig.args[0], torch.fx.Node):
        return None
    g, hmn = sig.args[0], shape(bmm)
    if hmn is None or shape(g) != (hmn[1], hmn[0], hmn[2]) or shape(mul) != shape(g) or dtype(g) != dtype(bmm):
        return None
    if not replays_to(chain, hmn, lambda t: t.permute(1, 0, 2)):
        return None
    if order[g] > order[bmm]:  # the model views the gate right before the multiply: move that view up
        flat = []
        torch.fx.node.map_arg((g.args, g.kwargs), flat.append)
        if not is_call(g, *_CHAIN_OPS) or any(order[a] > order[bmm] for a in flat):
            return None
        bmm.prepend(g)
    return mul, g, n


def _has_weight(n) -> bool:
    """An mm / addmm with a weight matrix (a graph input of 2 or more dims, through views and
    transposes) as an operand, or a bmm whose right operand is a view of one. A vector parameter
    viewed as a column is not one: `einsum("smh,h->sm", x, w)` (the AttnRes logits) is a bmm of batch 1
    that Inductor makes `mm(x, w[:, None])` on a GPU (joint_graph.bmm_to_mm), where it keeps the bmm
    on CPU; neither is a decode GEMM."""
    if is_call(n, aten.bmm.default):
        return _weight_chain(n.args[1])[0] is not None
    if not is_call(n, aten.mm.default, aten.addmm.default):
        return False
    ops = n.args[:2] if n.target is aten.mm.default else n.args[1:3]
    srcs = [strip(_weight_of(o)[0] if i else o, converts=True) for i, o in enumerate(ops)]
    return any(is_weight_like(s) and len(shape(s) or ()) >= 2 for s in srcs)


@register
class LowerDecodeGemm(K3Pass):
    name = "lower_decode_gemm"
    description = "decode GEMMs left in the graph (x @ W.T, W a weight) -> k3::decode_gemm; per-head bmm -> k3::decode_bmm"
    pattern = ("mm(x [M <= 16, K], permute(W [N, K])) with W a graph input (every such GEMM); "
               "bmm(x [H, M <= 16, K], views of W [H, K, N] or of W [H, N, K] transposed)")
    emits = "k3::decode_gemm, k3::decode_bmm"

    def expected(self, info):
        # the GEMMs left depend on which passes ran before this one; run() counts them then
        return 0

    def run(self, graph, info, opts, report):
        cands = [n for n in graph.nodes if _has_weight(n)]
        report.expected = len(cands)
        order = {n: i for i, n in enumerate(graph.nodes)}
        gated = 0
        done = {}   # a GEMM already replaced -> its op (a GEMM may read another's output: f_a -> f_b)
        for mm, x, w, *nk in self.collect(cands, lambda n: self.match(n, opts), report):
            x = done.get(x, x)
            gate = _gate_of(mm, order) if nk else None
            with graph.inserting_before(mm):
                if not nk:
                    new = graph.call_function(OPS["decode_gemm"], (x, w))
                else:
                    new = graph.call_function(OPS["decode_bmm"], (x, w, nk[0]) + ((gate[1],) if gate else ()))
            new.meta.update({k: v for k, v in mm.meta.items() if k in ("stack_trace",)})
            v = mm.meta.get("val")
            if nk and v is not None:   # the op's layout: token-major storage
                new.meta["val"] = v.new_empty(v.shape[1], v.shape[0], v.shape[2]).permute(1, 0, 2)
            elif v is not None:
                new.meta["val"] = v
            mm.replace_all_uses_with(new)
            graph.erase_node(mm)
            done[mm] = new
            if gate:
                mul, _, end = gate
                mul.replace_all_uses_with(end)
                graph.erase_node(mul)
                gated += 1
            report.matched += 1
        if gated:
            report.notes.append(f"{gated} per-head bmm(s) took their sigmoid output gate (k3::decode_bmm's gate)")

    @staticmethod
    def match(n, opts):
        if n.target is aten.bmm.default:
            return LowerDecodeGemm.match_bmm(n, opts)
        if n.target is aten.addmm.default:
            return Fail(n, "addmm written by the model (a bias or residual added in the GEMM): not lowered: "
                           "k3::decode_gemm has no epilogue, and apart the GEMM would round before the add")
        x, b = n.args
        w, layout = _weight_of(b)
        if not is_weight_like(w):
            return Fail(n, "the weight is the left operand (W @ x)")
        if layout != "out_in":
            return Fail(n, "weight stored [in, out] (x @ W): the kernel streams rows of an [out, in] weight")
        xs, ws = shape(x), shape(w)
        if xs is None or ws is None or len(xs) != 2 or len(ws) != 2:
            return Fail(n, f"not a 2-D x @ W^T (shapes {xs}, {ws})")
        dt = str(dtype(x)).replace("torch.", "")
        if dt not in opts.dtypes or dtype(w) != dtype(x):
            return Fail(n, f"dtype {dtype(x)} x {dtype(w)} (supported: {', '.join(opts.dtypes)})")
        if isinstance(xs[0], int) and xs[0] > 16:
            return Fail(n, f"M={xs[0]} tokens: more than one MMA tile (16)")
        v = val(w)
        if v is not None and v.stride(-1) != 1:
            return Fail(n, "weight not contiguous along K")
        return n, x, w

    @staticmethod
    def match_bmm(n, opts):
        x = n.args[0]
        got = _bmm_weight(n)
        if isinstance(got, Fail):
            return got
        w, w_nk = got
        xs = shape(x)
        if xs is None or len(xs) != 3:
            return Fail(n, f"x is not [H, M, K] (shape {xs})")
        dt = str(dtype(x)).replace("torch.", "")
        if dt not in opts.dtypes or dtype(w) != dtype(x):
            return Fail(n, f"dtype {dtype(x)} x {dtype(w)} (supported: {', '.join(opts.dtypes)})")
        if isinstance(xs[1], int) and xs[1] > 16:
            return Fail(n, f"M={xs[1]} tokens: more than one MMA tile (16)")
        return n, x, w, w_nk
