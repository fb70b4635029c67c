"""fold_kda_fb: the KDA gate's up-projection (f_b) folded into the decode step's recurrence kernel.

Matches, once per KDA layer at decode (anchored on each auto-functionalized k3::kda_decode_gated,
which fold_kda_gate emits), the gate input f of that core:
    f = view(mm(Fa, permute(W_fb)), [M, H, K])      F.linear(fa, f_b).view(M, H, K) in the model
with W_fb [H * K, R] a weight stored [out, in] (a graph input), Fa [M, R] of the weight's dtype
(`patterns.graph.match_linear`), the product read by that view alone and the view by the core alone.
Emits, in the same auto_functionalized node (the state update stays functionalised):
    o = k3::kda_decode_fb(Xq, Xk, v, Fa, W_fb, B, A_log, dt_bias, state, lower, scale, eps, qk_dtype)
whose CUDA path is one Triton kernel (kernels/triton_kda.py): per (token, head, 32 value columns)
the head's f (a K x R GEMV, rounded to the model dtype as F.linear's output), the norms, the gate,
beta's sigmoid and the recurrence, where a cuBLAS GEMV and fla-core's fused_recurrent_kda ran one
after the other (at M=1, TP=8 widths, 2.6 + 3.9 us and a 0.4 us gap on an H200, kernel timeline).
Its reference is the mm, then k3::kda_decode_gated's reference: exact on CPU.
Near-misses: f is not a linear of a [H * K, R] weight (a bias or residual folded into addmm, a
weight stored [in, out], another dtype), or the product or its view has other readers.
Expected: one site per KDA decode core; a core fold_kda_gate left as k3model::kda_decode is a
near-miss that says so. Skipped: model dtype / TP size
not supported, static M outside the pass's batch range; on CUDA with Inductor, M outside
its pipeline row's CUDA range (passes/pipeline.py) (M = 1..16: 2.2 us per KDA layer step at M=1 on an H200, one kernel fewer).
"""
from __future__ import annotations

from ..ops import OPS
from ..patterns.graph import Fail, dtype, match_linear, shape
from ..patterns.structure import op_name
from .base import K3Pass
from .pipeline import register
from .common import kda_decode_cores, retarget_functionalized

_CORE = "k3::kda_decode_gated"


@register
class FoldKdaFb(K3Pass):
    name = "fold_kda_fb"
    core = "KDA"   # rewrites the reference model's KDA attention-core op: skipped (with a reason) without it
    description = "KDA gate up-projection (f_b GEMV) + the gated recurrence -> k3::kda_decode_fb"
    pattern = "kda_decode_gated(..., f=view(mm(fa, f_b^T)), ...) (per KDA decode layer, after fold_kda_gate)"
    emits = "k3::kda_decode_fb, in place of kda_decode_gated"

    def expected(self, info):
        return len(kda_decode_cores(info.attention))   # one per KDA decode layer

    def run(self, graph, info, opts, report):
        cores = kda_decode_cores(graph.nodes)   # (info may predate fold_kda_gate's cores)
        report.expected = len(cores)
        for node, lin in self.collect(cores, self.match, report):
            kw = {k: v for k, v in node.kwargs.items() if k != "f"}
            retarget_functionalized(node, OPS["kda_decode_fb"], dict(
                q=kw.pop("q"), k=kw.pop("k"), v=kw.pop("v"), fa=lin.x, f_b=lin.w, **kw))
            report.matched += 1

    @staticmethod
    def match(node):
        if op_name(node) != _CORE:
            return Fail(node, f"the KDA decode core is {op_name(node)}: fold_kda_gate did not fold its prologue "
                              f"(disabled, gated off or a near-miss there), and this pass folds into its {_CORE}")
        f = node.kwargs.get("f")
        if f is None:
            return Fail(node, "kda_decode_gated is not called with keyword argument f")
        lin = match_linear(f)
        if isinstance(lin, Fail):
            return lin
        fs, q = shape(f), shape(node.kwargs.get("q"))
        if lin.residual is not None or lin.bias is not None:
            return Fail(lin.nodes[0], "the gate's up-projection has a bias or residual folded into addmm")
        if lin.w_layout != "out_in":
            return Fail(lin.w, "the gate's up-projection weight is stored [in, out], not F.linear's [out, in]")
        ws, xs = shape(lin.w), shape(lin.x)
        if fs is None or q is None or ws is None or xs is None or len(fs) != 3 or tuple(fs) != tuple(q) \
                or len(ws) != 2 or ws[0] != fs[1] * fs[2] or len(xs) != 2 or xs[1] != ws[1]:
            return Fail(f, f"the gate input {fs} is not fa [M, R] @ f_b [H * K, R]^T viewed as q's [M, H, K] "
                           f"(fa {xs}, f_b {ws}, q {q})")
        if dtype(lin.x) != dtype(lin.w):
            return Fail(lin.x, f"fa and f_b differ in dtype ({dtype(lin.x)}, {dtype(lin.w)})")
        prod = lin.nodes[0]
        chain = [prod]
        n = f
        while n is not prod:   # the views between the product and the core: each read once
            chain.append(n)
            n = n.args[0]
        if any(len(c.users) != 1 for c in chain):
            return Fail(prod, "the gate's up-projection (or its view) is read elsewhere too: folding would compute it twice")
        return node, lin
