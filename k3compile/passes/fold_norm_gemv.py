"""fold_norm_gemv: an RMSNorm whose only reader is a decode GEMM, folded into that GEMM's x loads.

Runs after lower_decode_gemm, over the k3::decode_gemm nodes it emitted. In K3 the sites are the
MLA query path, q_a = rms_norm(q_a, g_qa) read only by the q_b projection (one per MLA layer), and
the first layer's input norm (the embedding has no residual before it) read only by that layer's
input projection; the other norms before GEMMs are the AttnRes / residual norms that
fuse_residual_norm and fuse_oproj_allreduce fold into their ops.

Matches, per site: `k3::decode_gemm(rms_norm(X, g, eps), W)` with the norm (`patterns.graph.
match_rms_norm`: fp32 cast, x * rsqrt(mean(x^2) + eps), times g, cast back) read by nothing else.
Expected: every k3::decode_gemm whose x is an RMSNorm's output read by that GEMM alone (a norm that
other nodes read too is no site: folding would compute it twice; the report notes how many).
Near-misses: a norm without a [K] weight, mixed dtypes.
Emits: `k3::decode_gemm_normed(X, g, eps, W)`. On CUDA, where kernels/choose.GEMV_TABLE picks the
CUDA-core GEMV for this weight and M (the MLA q_b at M=1), one kernel computing
rsqrt(mean(X^2) + eps) * ((X * g) @ W.T), the squares summed in the product's loop (so the normed
x is not rounded to bf16 as the model rounds it: within bf16 noise of the reference); elsewhere one
Triton norm kernel and decode_gemm's path (what Inductor's norm kernel and the GEMM were).
Reference: model.functional.rms_norm then x @ W.T, exact on CPU.
Skipped: model dtype / TP size not supported, static M outside the pass's batch range; on CUDA with
Inductor at every M (options.CUDA_PROFITABLE_M: the MLA layer measured no faster with it on an H200,
the GEMV taking 6.1-6.3 us with the norm instead of 4.8; gate="off" applies it).
"""
from __future__ import annotations

import torch

from ..ops import OPS
from ..patterns.graph import Fail, dtype, is_call, match_rms_norm, shape
from .base import K3Pass


def _sole_reader(n, site) -> bool:
    """Whether the GEMM n is the only reader of its normed x (and of the norm's inner product)."""
    return len(n.args[0].users) == 1 and all(len(m.users) == 1 for m in site.nodes[1:] if isinstance(m, torch.fx.Node))


class FoldNormGemv(K3Pass):
    name = "fold_norm_gemv"
    needs = ("lower_decode_gemm",)
    description = "RMSNorm read only by a decode GEMM -> k3::decode_gemm_normed (the norm in the GEMV's x loads)"
    pattern = "k3::decode_gemm(rms_norm(x, g, eps), W), the norm read by nothing else (MLA q_a -> q_b)"
    emits = "k3::decode_gemm_normed"

    def expected(self, info):
        return 0   # counted in run(): the decode GEMMs lower_decode_gemm left

    def run(self, graph, info, opts, report):
        # each decode GEMM whose x is an RMSNorm's output, with that norm (matched once here)
        normed = {n: site for n in graph.nodes if is_call(n, OPS["decode_gemm"]) if (site := match_rms_norm(n.args[0]))}
        cands = [n for n, site in normed.items() if _sole_reader(n, site)]
        report.expected = len(cands)
        if len(normed) > len(cands):
            report.notes.append(f"{len(normed) - len(cands)} decode GEMM(s) read a norm that other nodes read too: "
                                "left as they are")
        for n, site in self.collect(cands, lambda n: self.match(n, normed[n]), report):
            with graph.inserting_before(n):
                new = graph.call_function(OPS["decode_gemm_normed"], (site.x, site.weight, site.eps, n.args[1]))
            new.meta.update({k: v for k, v in n.meta.items() if k in ("val", "stack_trace")})
            n.replace_all_uses_with(new)
            graph.erase_node(n)
            report.matched += 1

    @staticmethod
    def match(n, site):
        x = n.args[0]
        if site.weight is None or shape(site.weight) != (shape(site.x) or (None,))[-1:]:
            return Fail(x, "the RMSNorm has no weight of x's width")
        if dtype(x) != dtype(site.x) or dtype(site.weight) != dtype(site.x):
            return Fail(x, f"the norm's input {dtype(site.x)}, weight {dtype(site.weight)} and output {dtype(x)} differ")
        return n, site
