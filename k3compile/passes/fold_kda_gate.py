"""fold_kda_gate: the KDA decode step's prologue folded into its recurrence kernel.

Matches, once per KDA layer at decode (anchored on each auto-functionalized k3model::kda_decode):
    q    = [convert] (normalize(Xq) * scale)          normalize: x / clamp_min(||x||_2, eps) per head
    k    = [convert]  normalize(Xk)
    g    = lower * sigmoid(exp(A_log) * (F + dt_bias))
    beta = sigmoid(B)
    o    = k3model::kda_decode(q, k, v, g, beta, state)          (mutates state)
(`patterns.kda` has the ATen forms.)
Emits, in the same auto_functionalized node (so the state update stays functionalised):
    o    = k3::kda_decode_gated(Xq, Xk, v, F, B, A_log, dt_bias, state, lower, scale, eps, q.dtype)
whose CUDA path is one fla-core fused_recurrent_kda kernel doing the norms, the gate and beta's
sigmoid in-kernel (instead of Inductor's normalisation and gate kernels before the recurrence);
its reference is the matched math followed by the model's own kda_decode. Numerics on CUDA: fla
normalises by sqrt(sum(x^2) + 1e-6) and keeps the normalised q, k in fp32 (the model rounds them
to q's dtype); the CPU reference is exact.
Skipped: model dtype / TP size not supported, static M outside the pass's batch range; on CUDA with
Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py) (M = 1..16: 1.3-1.6 us faster per KDA layer step at
M=1 alone; at 4 and 16 faster only with fold_kda_conv and fold_kda_fb, the three 9.3 / 7.8 us). Prefill (kda_prefill) is left as it is.
"""
from __future__ import annotations

from ..ops import OPS
from ..patterns.graph import Fail
from ..patterns.kda import match_kda_prologue
from ..patterns.structure import op_name
from .base import K3Pass
from .pipeline import register
from .common import retarget_functionalized

_KDA_DECODE = "k3model::kda_decode"


@register
class FoldKdaGate(K3Pass):
    name = "fold_kda_gate"
    core = "KDA"   # rewrites the reference model's KDA attention-core op: skipped (with a reason) without it
    description = "KDA decode prologue (q/k L2 norm, gate, beta sigmoid) + recurrence -> k3::kda_decode_gated"
    pattern = "kda_decode(l2norm(q), l2norm(k), v, gate(f), sigmoid(b), state) (per KDA decode layer)"
    emits = "k3::kda_decode_gated, in place of kda_decode"

    def expected(self, info):
        return sum(op_name(n) == _KDA_DECODE for n in info.attention)

    def run(self, graph, info, opts, report):
        cores = [n for n in info.attention if op_name(n) == _KDA_DECODE]
        for node, s in self.collect(cores, self.match, report):
            kw = {k: v for k, v in node.kwargs.items() if k not in ("q", "k", "v", "g", "beta")}  # the state's
            retarget_functionalized(node, OPS["kda_decode_gated"], dict(
                q=s.q.x, k=s.k.x, v=node.kwargs["v"], f=s.f, beta=s.beta, a_log=s.a_log, dt_bias=s.dt_bias,
                lower=s.lower, scale=s.q.scale, eps=s.q.eps, qk_dtype=s.qk_dtype, **kw))
            report.matched += 1

    @staticmethod
    def match(node):
        if not node.args or getattr(node.args[0], "_schema", None) is None:
            return Fail(node, "kda_decode is not an auto-functionalized call (already reinplaced?)")
        s = match_kda_prologue(node)
        return s if isinstance(s, Fail) else (node, s)
