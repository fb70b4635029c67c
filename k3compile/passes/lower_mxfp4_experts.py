"""lower_mxfp4_experts: routed MXFP4 experts written in plain torch -> the k3 expert op.

Matches, once per MoE layer (found by role: patterns.roles; its router top-k gives the ids and the
weights, the finalize the experts' unweighted outputs y [M, k, L]): the region computing y from the
latent x [M, L] and the ids, reading the packed MXFP4 weights (patterns.moe.experts), however the
dequantisation is written (a value table that is a constant, or the E2M1 bits decoded by arithmetic;
the E8M0 scale by ldexp, exp2 or pow; gather then einsum / bmm / matmul). It is verified by running
it on random codes, scales, latent and ids against k3model::mxfp4_experts (SiTU beta 4 / linear
beta 25, or the region's own tanh divisors).
Emits:
    y = k3::mxfp4_experts(x, ids, w13, w13_scale, w2, w2_scale, beta, linear_beta)   # [M, k, L], x.dtype
(cast to y's dtype where the model kept y in fp32: one bf16 rounding of the expert outputs). On
CUDA the op runs the MXFP4 expert kernels (CuTe or Triton); the model's region dequantised every
selected expert's weights into fp32 tensors first.
Not counted as expected: a MoE whose experts are already an expert op (k3model::mxfp4_experts, an
op named in the expert_ops knob); a MoE whose experts are inside vLLM's opaque MoE op (a near-miss
naming the op). Near-miss: experts in an opaque op of another project, a value table
that is a graph input (its values are not known when compiling), another weight layout or
activation (the evaluation differs).
Skipped: every MoE's experts an expert op already (the reference model); model dtype not in
options.dtypes, TP size not in options.tp_sizes; on CUDA with Inductor, until measured on the GPU
(options.CUDA_UNMEASURED; gate="off" applies it).
"""
from __future__ import annotations

import operator

import torch

from ..ops import OPS
from ..patterns.graph import CONVERT_OPS, Fail, aten, dtype, is_call, strip
from ..patterns.moe import experts, finalize, selection
from ..patterns.roles import op_name
from ..patterns.structure import EXPERT_OPS
from ..patterns.vllm_forms import Prefused, inside_moe_op
from .base import K3Pass
from .common import emit, last_of, replace
from .pipeline import register


@register
class LowerMxfp4Experts(K3Pass):
    name = "lower_mxfp4_experts"
    description = "routed MXFP4 experts in plain torch (dequantise + einsum) -> k3::mxfp4_experts"
    pattern = "y[M, k, L] from x[M, L], ids and uint8 w13 / w2 codes + E8M0 scales (per MoE layer)"
    emits = "k3::mxfp4_experts"

    def expected(self, info):
        return info.n_moe

    def skip_reason(self, info, opts):
        if info.experts and len(info.experts) >= len(info.moe):
            return "every MoE's experts are an expert op already: no plain-torch experts to lower"
        return super().skip_reason(info, opts)

    def run(self, graph, info, opts, report):
        for site in self.collect(info.moe if info.by_role else [], self.match, report):
            args = (site.x, site.ids, site.w13, site.w13_scale, site.w2, site.w2_scale, site.beta, site.linear_beta)
            ids = site.ids
            if dtype(ids) != torch.int64:   # the op takes int64 ids
                with graph.inserting_after(ids):
                    ids = graph.call_function(torch.ops.prims.convert_element_type.default, (ids, torch.int64))
                ids.meta["val"] = site.ids.meta["val"].to(torch.int64)
                args = (site.x, ids, *args[2:])
            op = emit(graph, last_of(graph, [a for a in args if hasattr(a, "op")]), OPS["mxfp4_experts"], args)
            out = op
            if dtype(site.y) != dtype(op):
                with graph.inserting_after(op):
                    out = graph.call_function(torch.ops.prims.convert_element_type.default, (op, dtype(site.y)))
                out.meta["val"] = op.meta["val"].to(dtype(site.y))
            replace(graph, site.y, out)
            report.matched += 1

    def match(self, r):
        if r.op is not None:
            return inside_moe_op(r, "the routed experts")
        topk = r.topk
        if is_call(topk, aten.topk.default):
            sel = selection(topk)
            if isinstance(sel, Fail):
                return sel
            ids, w = sel.ids, sel.weights
        else:   # k3::router_topk (fuse_router_topk)
            outs = {u.args[1]: u for u in topk.users if is_call(u, operator.getitem)}
            ids, w = outs.get(0), outs.get(1)
            if ids is None or w is None:
                return Fail(topk, "the router op's ids or weights are not used")
        f = finalize(w)
        if isinstance(f, Fail):
            return f
        y = f[0]
        src = strip(y, converts=True)
        if op_name(src) in EXPERT_OPS or is_call(src, OPS["mxfp4_experts"]):
            return Prefused(y, f"compute their experts in an expert op already ({op_name(src)})")
        while is_call(y, *CONVERT_OPS):   # the experts' own result, before the model's cast
            y = y.args[0]
        return experts(y, ids)
