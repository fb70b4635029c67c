"""fold_resnorm_moe: the post-attention residual add + AttnRes / RMSNorm, at TP=1, folded into the two
GEMMs that read the MoE input (the router + latent down-projection, and the shared expert's gate-up).

Runs after fuse_oproj_allreduce, shard_router_latent and overlap_shared_expert, over their ops.
Matches, per MoE layer:
    updated, x = k3::oproj_allreduce_residual(o, W_o, prefix, blocks, w_norm, w_qk, g, eps, group=None, prefetch=[])
    logits, lat = k3::router_latent_sharded(x, W_r, W_down, 0, 1, None)
    shared = k3::shared_expert_async(x, W_gu, W_dn, beta, lbeta, after=...)      # x read by these two alone
Emits:
    delta = k3::decode_gemm(o, W_o)                                  # the o-proj GEMM alone
    updated, logits, lat = k3::residual_norm_router_latent(delta, prefix, blocks, w_norm, w_qk, g, eps, W_r, W_down)
    shared = k3::shared_expert_async_resnorm(delta, prefix, blocks, w_norm, w_qk, g, eps, W_gu, W_dn, beta, lbeta, after=...)
On CUDA the norm kernel between the o-proj GEMM and the router GEMM goes (5-6 us at M=1 on an H200):
the router + latent launch (kernels/triton_resgemm.py over both weights) and the side stream's
gate-up GEMM each accumulate the mixer's sums in their own K loop, as fold_resnorm_gemm's op does
(results within the model dtype's rounding of the reference; `updated` exact).
Reference: the three ops' references, exact on CPU.
Expected: every TP=1 o-proj op whose normed output the router op reads (one per MoE layer).
Near-misses: the normed output read by other nodes too, an L2 prefetch list. Not sites (a note says how
many): layers whose (blocks + 2) x M rows do not fit one 16-row MMA tile at a static M (M = 4 with 3
blocks): each GEMM would run the norm kernel itself, twice the unfolded op's work. A dynamic M is
folded, the ops choosing at run time.
Skipped: TP > 1 (the o-proj op's all-reduce kernel stays, with the norm in it), model dtype / static M
outside the pass's range; on CUDA with Inductor outside options.CUDA_PROFITABLE_M (unmeasured until
the first GPU run).
"""
from __future__ import annotations

from ..ops import OPS
from ..patterns.graph import Fail, is_call, shape
from .base import K3Pass
from .common import emit, getitem, inherit
from .fold_resnorm_gemm import outputs, tp1_only


class FoldResnormMoe(K3Pass):
    name = "fold_resnorm_moe"
    needs = ("fuse_oproj_allreduce", "shard_router_latent", "overlap_shared_expert")
    description = ("post-attention residual + AttnRes/RMSNorm (TP=1) -> folded into the router + latent and "
                   "shared gate-up GEMMs")
    pattern = "k3::oproj_allreduce_residual(...)[1] read by k3::router_latent_sharded and k3::shared_expert_async, TP=1"
    emits = "k3::residual_norm_router_latent, k3::shared_expert_async_resnorm, k3::decode_gemm"

    def expected(self, info):
        return 0   # counted in run(): the o-proj ops whose normed output a router op reads

    def skip_reason(self, info, opts):
        return tp1_only(info, super().skip_reason(info, opts), "the o-proj op")

    def run(self, graph, info, opts, report):
        cands = []
        for n in graph.nodes:
            if is_call(n, OPS["oproj_allreduce_residual"]):
                x = outputs(n, 2)[1]
                if x is not None and any(is_call(u, OPS["router_latent_sharded"]) and u.args[0] is x for u in x.users):
                    cands.append(n)
        fits = [n for n in cands if _fits(n)]
        if len(fits) < len(cands):
            report.notes.append(f"{len(cands) - len(fits)} site(s) left as they are: their blocks + the residual and "
                                f"delta rows of M={info.m_static} token(s) do not fit one 16-row MMA tile (each GEMM "
                                "would run the norm kernel itself)")
        report.expected = len(fits)
        for n, rl, sh in self.collect(fits, lambda n: self.match(n, info), report):
            o, w_o, prefix, blocks, w_norm, w_qk, g, eps = n.args[:8]
            with graph.inserting_after(n):
                delta = inherit(graph.call_function(OPS["decode_gemm"], (o, w_o)), n)
            delta.meta["val"] = n.meta["val"][0]
            src = (delta, prefix, blocks, w_norm, w_qk, g, eps)
            new_rl = emit(graph, delta, OPS["residual_norm_router_latent"], (*src, rl.args[1], rl.args[2]))
            upd, logits, lat = (getitem(graph, new_rl, i) for i in range(3))
            old_upd, old_x = outputs(n, 2)
            if old_upd is not None:
                old_upd.replace_all_uses_with(upd)
                graph.erase_node(old_upd)
            for i, item in enumerate(outputs(rl, 2)):
                if item is not None:
                    item.replace_all_uses_with((logits, lat)[i])
                    graph.erase_node(item)
            graph.erase_node(rl)
            with graph.inserting_before(sh):
                new_sh = graph.call_function(OPS["shared_expert_async_resnorm"], (*src, *sh.args[1:]), dict(sh.kwargs))
            new_sh.meta.update({k: v for k, v in sh.meta.items() if k in ("val", "stack_trace")})
            inherit(new_sh, sh)
            sh.replace_all_uses_with(new_sh)
            graph.erase_node(sh)
            graph.erase_node(old_x)
            graph.erase_node(n)
            report.matched += 1

    @staticmethod
    def match(n, info):
        group, prefetch = n.args[8], n.args[9] if len(n.args) > 9 else []
        if group is not None:
            return Fail(n, f"the op all-reduces over {group!r} (the fold is TP=1 only)")
        if prefetch:
            return Fail(n, f"the op carries an L2 prefetch of {len(prefetch)} weight(s) (the fold would drop it)")
        if n.args[6] is None:
            return Fail(n, "the op computes no norm (g is None)")
        x = outputs(n, 2)[1]
        readers = list(x.users)
        rl = [u for u in readers if is_call(u, OPS["router_latent_sharded"]) and u.args[0] is x and len(u.args) < 7]
        sh = [u for u in readers if is_call(u, OPS["shared_expert_async"]) and u.args[0] is x and len(u.args) < 7]
        if len(readers) != 2 or len(rl) != 1 or len(sh) != 1:
            return Fail(x, f"the normed output is read by {', '.join(u.name for u in readers)}, not by one router "
                           "op and one shared-expert op alone")
        if rl[0].args[4] != 1 or rl[0].args[5] is not None:
            return Fail(rl[0], "the router op is sharded over ranks (the fold is TP=1 only)")
        return n, rl[0], sh[0]


def _fits(n) -> bool:
    """Whether the site's (blocks + 2) x M rows fit one MMA tile at its static M (a dynamic M: the ops
    decide at run time, folding where the rows fit and running the norm kernel first elsewhere)."""
    m = (shape(n.args[2]) or (None,))[0]
    return not isinstance(m, int) or (len(n.args[3]) + 2) * m <= 16
