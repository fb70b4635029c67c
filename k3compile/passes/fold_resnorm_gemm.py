"""fold_resnorm_gemm: a layer's input residual add + AttnRes / RMSNorm, at TP=1, folded into the one
decode GEMM that reads the normed row (the attention's input projection).

Runs after fuse_residual_norm and lower_decode_gemm, over their ops. Matches, per site:
    updated, normed = k3::residual_norm(delta, prefix, blocks, w_norm, w_qk, g, eps, group=None, prefetch=[])
    y = k3::decode_gemm(normed, W)          # normed read by this GEMM alone
Emits:
    updated, y = k3::residual_norm_gemm(delta, prefix, blocks, w_norm, w_qk, g, eps, W)
On CUDA one Triton kernel (kernels/triton_resgemm.py) where the tuned GEMV table runs W on the MMA
decode GEMM and the (blocks + 2) x M source rows fit its 16-row tile (M = 1..3 with 3 AttnRes
blocks): the mixer's sums (squares, cross products, logits) accumulate in the GEMM's own K loop, so
the small norm kernel (one program per token, 5-6 us at M=1 on an H200) and its launch go. Elsewhere
residual_norm's kernel and the decode GEMM, as before. The result is within the model dtype's
rounding of the reference (the reference rounds the normed row to bf16 before the GEMM; the kernel
rounds only x * g, the MMA's operand); `updated` is exact.
Reference: k3::residual_norm then x @ W.T, exact on CPU.
Expected: every layer-input k3::residual_norm whose normed output a k3::decode_gemm reads (in K3:
the KDA in_proj and the MLA qkv_a of every layer but the first). Near-misses: the normed output read
by other nodes too (folding would compute it twice), an L2 prefetch list on the op.
Skipped: TP > 1 (there the op all-reduces delta first, and its kernel computes the norm beside the
peers' loads: no launch to save), model dtype / static M outside the pass's range; on CUDA with
Inductor outside options.CUDA_PROFITABLE_M (unmeasured until the first GPU run).
"""
from __future__ import annotations

import operator

from ..ops import OPS
from ..patterns.graph import Fail, is_call
from .base import K3Pass
from .common import emit, getitem


def outputs(n, k: int = 2):
    """The getitem nodes of a multi-output node, by index (None where an output is unread)."""
    out = [None] * k
    for u in n.users:
        if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int) and u.args[1] < k:
            out[u.args[1]] = u
    return out


def tp1_only(info, why: str | None, op: str) -> str | None:
    """The TP=1 folds' skip reason: the base one (dtype, M range, gate), else at TP > 1 that `op` keeps its
    all-reduce kernel, which computes the norm beside the peers' loads."""
    if why is None and info.tp > 1:
        return (f"TP={info.tp}: {op} all-reduces first and its kernel computes the norm beside the peers' loads, "
                "so there is no launch to save (the fold is TP=1 only)")
    return why


class FoldResnormGemm(K3Pass):
    name = "fold_resnorm_gemm"
    needs = ("fuse_residual_norm", "lower_decode_gemm")
    description = "layer-input residual + AttnRes/RMSNorm read by one decode GEMM (TP=1) -> k3::residual_norm_gemm"
    pattern = "k3::residual_norm(delta, prefix, blocks, ...) read by one k3::decode_gemm, TP=1 (KDA in_proj, MLA qkv_a)"
    emits = "k3::residual_norm_gemm"

    def expected(self, info):
        return 0   # counted in run(): the residual norms a decode GEMM reads

    def skip_reason(self, info, opts):
        return tp1_only(info, super().skip_reason(info, opts), "the layer input's op")

    def run(self, graph, info, opts, report):
        cands = []
        for n in graph.nodes:
            if is_call(n, OPS["residual_norm"]):
                normed = outputs(n)[1]
                if normed is not None and any(is_call(u, OPS["decode_gemm"]) and u.args[0] is normed
                                              for u in normed.users):
                    cands.append(n)
        report.expected = len(cands)
        for n, gemm in self.collect(cands, self.match, report):
            delta, prefix, blocks, w_norm, w_qk, g, eps = n.args[:7]
            new = emit(graph, n, OPS["residual_norm_gemm"], (delta, prefix, blocks, w_norm, w_qk, g, eps, gemm.args[1]))
            upd, y = getitem(graph, new, 0), getitem(graph, new, 1)
            old_upd, old_normed = outputs(n)
            if old_upd is not None:
                old_upd.replace_all_uses_with(upd)
                graph.erase_node(old_upd)
            gemm.replace_all_uses_with(y)
            graph.erase_node(gemm)
            graph.erase_node(old_normed)
            graph.erase_node(n)
            report.matched += 1

    @staticmethod
    def match(n):
        group, prefetch = n.args[7], n.args[8] if len(n.args) > 8 else []
        if group is not None:
            return Fail(n, f"the op all-reduces delta over {group!r} (the fold is TP=1 only)")
        if prefetch:
            return Fail(n, f"the op carries an L2 prefetch of {len(prefetch)} weight(s) (the fold would drop it)")
        normed = outputs(n)[1]
        readers = list(normed.users)
        if len(readers) != 1:
            return Fail(normed, f"the normed output is read by {len(readers)} nodes "
                                f"({', '.join(u.name for u in readers)}), not by one decode GEMM alone")
        return n, readers[0]
