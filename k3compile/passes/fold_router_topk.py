"""fold_router_topk: the router's top-k selection, at TP=1, run by the GEMM that computes its logits.

Runs after fuse_router_topk, shard_router_latent and fold_resnorm_moe (when that one runs), over their ops.
Matches, per MoE layer:
    logits, lat = k3::router_latent_sharded(x, W_r, W_down, 0, 1, None)          # TP=1: one launch over both
        (or: upd, logits, lat = k3::residual_norm_router_latent(delta, prefix, blocks, ..., W_r, W_down))
    ids, w = k3::router_topk(logits, bias, k, scale, ids_int32, after=...)
Emits, where the router op was:
    logits, lat, ids, w = k3::router_latent_topk(x, W_r, W_down, bias, k, scale, ids_int32)
        (or: upd, logits, lat, ids, w = k3::residual_norm_router_latent_topk(..., W_r, W_down, bias, k, scale, ids_int32))
The top-k's `after` (overlap_shared_expert's ordering after the side-stream fork) goes with it: the fork
still follows the router op, whose outputs it reads.
On CUDA the router + latent launch (the MMA decode GEMM over [W_r; W_down], or its norm-folded form)
counts the programs that stored a tile of the logits; the last one selects every token's experts as
k3::router_topk's kernel does (kernels/triton_router.topk_after_tile), reading the logits back from L2,
and the top-k launch goes (4.3-4.4 us at M=1 on an H200, plus the gap before it). The selection is the
same computation on the same logits: ids and weights equal router_topk's on them. Where the launch does not
run (no MMA config for the stacked shape, router rows not a multiple of its BN, no split counter) the op
runs router_topk's kernel after the GEMM.
Reference: the two ops' references in turn (exact on CPU).
Expected: every router_topk op whose logits come from a TP=1 router op (one per MoE layer).
Near-misses: logits from anything else (a view of the op's output, another op), a router op sharded over ranks.
Skipped: TP > 1 (the logits come from the all-gather kernel, which has every rank's tiles only after its
barrier; the top-k stays a kernel of its own), model dtype / static M outside the pass's range; on CUDA
with Inductor outside options.CUDA_PROFITABLE_M (unmeasured until the first GPU run).
"""
from __future__ import annotations

from ..ops import OPS
from ..patterns.graph import Fail, is_call
from .base import K3Pass
from .common import emit, getitem, last_of
from .fold_resnorm_gemm import outputs

_PRODUCERS = {"router_latent_sharded": ("router_latent_topk", 2, 0),            # (fused op, outputs, logits')
              "residual_norm_router_latent": ("residual_norm_router_latent_topk", 3, 1)}


def _producer(logits):
    """(router op, its kind) whose logits output `logits` is, else None."""
    import operator
    if not is_call(logits, operator.getitem):
        return None
    p, i = logits.args
    for kind, (_, _, li) in _PRODUCERS.items():
        if is_call(p, OPS[kind]) and i == li:
            return p, kind
    return None


class FoldRouterTopk(K3Pass):
    name = "fold_router_topk"
    needs = ("fuse_router_topk", "shard_router_latent")
    description = "router top-k (TP=1) -> run by the router + latent GEMM's last router program"
    pattern = ("k3::router_topk(logits) with logits from k3::router_latent_sharded (TP=1) or "
               "k3::residual_norm_router_latent")
    emits = "k3::router_latent_topk, k3::residual_norm_router_latent_topk"

    def expected(self, info):
        return 0   # counted in run(): the router_topk ops

    def skip_reason(self, info, opts):
        why = super().skip_reason(info, opts)
        if why is None and info.tp > 1:
            return (f"TP={info.tp}: the logits come from the all-gather kernel, which has every rank's tiles only "
                    "after its barrier, so the top-k stays a kernel of its own (the fold is TP=1 only)")
        return why

    def run(self, graph, info, opts, report):
        tops = [n for n in graph.nodes if is_call(n, OPS["router_topk"])]
        report.expected = len(tops)
        for top, p, kind in self.collect(tops, self.match, report):
            fused_kind, k_out, _ = _PRODUCERS[kind]
            logits, bias, k, scale = top.args[:4]
            ids_int32 = top.args[4] if len(top.args) > 4 else top.kwargs.get("ids_int32", False)
            args = (*p.args[:(9 if kind == "residual_norm_router_latent" else 3)], bias, k, scale, ids_int32)
            fused = emit(graph, last_of(graph, [p, bias]), OPS[fused_kind], args)
            items = [getitem(graph, fused, i) for i in range(k_out + 2)]
            for i, old in enumerate(outputs(p, k_out)):
                if old is not None:
                    old.replace_all_uses_with(items[i])
                    graph.erase_node(old)
            for i, old in enumerate(outputs(top, 2)):
                if old is not None:
                    old.replace_all_uses_with(items[k_out + i])
                    graph.erase_node(old)
            graph.erase_node(top)
            graph.erase_node(p)
            for it in items:
                if not it.users:
                    graph.erase_node(it)
            report.matched += 1

    @staticmethod
    def match(top):
        got = _producer(top.args[0])
        if got is None:
            return Fail(top, f"its logits ({top.args[0].name}) are not the logits output of a TP=1 router op "
                             "(k3::router_latent_sharded / k3::residual_norm_router_latent)")
        p, kind = got
        if kind == "router_latent_sharded" and (p.args[4] != 1 or p.args[5] is not None):
            return Fail(p, "the router op is sharded over ranks (the fold is TP=1 only)")
        if kind == "router_latent_sharded" and len(p.args) > 6 and p.args[6]:
            return Fail(p, "the router logits are fp32 (the folded op computes them in the model dtype)")
        return top, p, kind
