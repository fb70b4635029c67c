"""lower_decode_gemm: the decode GEMMs the other passes leave in the graph, onto k3's decode GEMM.

Runs last, over what the other passes left: the attention input projections (KDA in_proj and
f_b, MLA qkv_a and q_b), the dense MLP, the LM head, and the MoE GEMMs of any MoE pass that did
not apply. Inductor hands these to cuBLAS, whose kernels read a decode weight at 1.3-3.9 TB/s on
an H200 (the KDA in_proj at TP=8 widths, 90 MB, at 2.4-2.9; bench/gemv_bench.py, BENCHMARKS.md,
thirteenth session).

Matches, per site: every `mm(x, W^T)` (F.linear without bias; W a 2-D weight, a graph input, in
F.linear's [out, in] layout; x [M, K] of the model dtype, M static <= 16 or dynamic).
Expected: every mm / addmm with a weight operand still in the graph when the pass runs; the ones
it cannot take are near-misses with the reason (a bias or residual folded into addmm, a weight
stored [in, out], another dtype, a weight on the left).
Emits: `k3::decode_gemm(x, W)`. On CUDA it runs the tensor-core split-K kernel with the tuned
config where `kernels/choose.GEMV_TABLE` has this weight shape and M (measured faster than
cuBLAS), else torch.mm: so a shape the table lacks costs nothing but the custom-op call.
Its reference is `x @ W.T`, exact on CPU.
Skipped: model dtype / TP size not supported, static M outside [1, 16] (one MMA tile of tokens);
on CUDA with Inductor, M outside options.CUDA_PROFITABLE_M.
"""
from __future__ import annotations

import torch

from ..ops import OPS
from ..patterns.graph import Fail, _weight_of, dtype, is_call, is_weight_like, shape, strip, val
from .base import K3Pass

aten = torch.ops.aten


def _has_weight(n) -> bool:
    """An mm / addmm with a weight (a graph input, through views and transposes) as an operand."""
    if not is_call(n, aten.mm.default, aten.addmm.default):
        return False
    ops = n.args[:2] if n.target is aten.mm.default else n.args[1:3]
    return any(is_weight_like(_weight_of(o)[0] if i else strip(o, converts=True)) for i, o in enumerate(ops))


class LowerDecodeGemm(K3Pass):
    name = "lower_decode_gemm"
    description = "decode GEMMs left in the graph (x @ W.T, W a weight) -> k3::decode_gemm"
    pattern = "mm(x [M <= 16, K], permute(W [N, K])) with W a graph input (every such GEMM)"
    emits = "k3::decode_gemm"

    def expected(self, info):
        # the GEMMs left depend on which passes ran before this one; run() counts them then
        return 0

    def run(self, graph, info, opts, report):
        cands = [n for n in graph.nodes if _has_weight(n)]
        report.expected = len(cands)
        for mm, x, w in self.collect(cands, lambda n: self.match(n, opts), report):
            with graph.inserting_before(mm):
                new = graph.call_function(OPS["decode_gemm"], (x, w))
            new.meta.update({k: v for k, v in mm.meta.items() if k in ("val", "tensor_meta", "stack_trace")})
            mm.replace_all_uses_with(new)
            graph.erase_node(mm)
            report.matched += 1

    @staticmethod
    def match(n, opts):
        if n.target is aten.addmm.default:
            return Fail(n, "addmm (a bias or residual folded into the GEMM): not lowered")
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
