"""Rank functions for the multi-rank compiler tests (importable by spawned processes)."""
from __future__ import annotations

import operator

import torch

PASS_SETS = {
    "none": (),
    "shard_router_latent": ("shard_router_latent",),
    "fuse_router_topk": ("fuse_router_topk",),
    "fold_moe_finalize": ("fold_moe_finalize",),
    "fuse_oproj_allreduce": ("fuse_oproj_allreduce",),
    "fuse_residual_norm": ("fuse_residual_norm",),   # alone: it must leave the post-attention mixers
    "overlap_shared_expert": ("overlap_shared_expert",),
    "fold_kda_conv": ("fold_kda_conv",),
    "fold_mla_prologue": ("fold_mla_prologue",),
    "all": ("shard_router_latent", "fuse_router_topk", "fold_moe_finalize", "fuse_oproj_allreduce",
            "fuse_residual_norm", "fold_kda_conv", "fold_mla_prologue", "overlap_shared_expert", "lower_decode_gemm",
            "fold_mla_output", "pair_pdl"),
}


def compiled_vs_eager(rank, world, batches, pass_sets, num_layers=8, style=None):
    """For each pass set: compile once, decode 2 steps per batch size, return max |diff| and reports.
    `batches`: the batch sizes, or a dict pass set -> batch sizes; `num_layers`: the layers, or a dict
    pass set -> layers (4 layers hold every layer kind: a dense KDA layer, KDA and MLA MoE layers,
    an AttnRes block boundary)."""
    import k3compile
    from k3compile.model import K3Config, K3Model, TPInfo
    if style:
        import styles
        styles.apply(style)
    models = {}
    out = {}
    for name in pass_sets:
        n = num_layers[name] if isinstance(num_layers, dict) else num_layers
        if n not in models:
            cfg = K3Config.tiny(dtype="bfloat16", num_layers=n)
            models[n] = cfg, K3Model(cfg, TPInfo.current())
        cfg, model = models[n]
        torch._dynamo.reset()
        k3compile.clear_reports()
        f = torch.compile(model, backend=k3compile.backend(mode="eager", passes=PASS_SETS[name]), fullgraph=True)
        worst = 0.0
        for M in (batches[name] if isinstance(batches, dict) else batches):
            ce, cc = model.new_cache(M), model.new_cache(M)
            g = torch.Generator().manual_seed(M)
            for _ in range(2):
                ids = torch.randint(0, cfg.vocab, (M, 1), generator=g)
                ref = model(ids, ce)
                got = f(ids, cc)
                worst = max(worst, (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6))
        reps = k3compile.reports()
        out[name] = dict(err=worst, compiles=len(reps),
                         passes={p.name: (p.matched, p.expected, p.skipped, p.error) for p in reps[-1].passes})
    return out


def rewritten_graph_ops(rank, world):
    """Counts in the graph the passes leave, tiny model at TP=world, no pass vs every pass:
    functional all-reduces, orphan collectives (nobody uses their result), aten.mm nodes, aten.topk
    and k3::router_topk nodes, k3::residual_norm nodes that all-reduce (a group argument)."""
    import k3compile  # noqa: F401
    from k3compile.compiler import _compile
    from k3compile.model import K3Config, K3Model, TPInfo
    from k3compile.options import K3Options
    from k3compile.passes.manager import PassManager
    from k3compile.patterns.graph import c10d, is_call, orphan_collectives
    cfg = K3Config.tiny(dtype="bfloat16")
    model = K3Model(cfg, TPInfo.current())
    EXPERTS = (torch.ops.k3.mxfp4_experts.default, torch.ops.k3model.mxfp4_experts.default)
    out = {}
    for name, passes in (("none", ()), ("all", None)):
        opts = K3Options.make(mode="eager", **({} if passes is None else {"passes": passes}))
        final = {}

        def observe(stage, pass_name, graph):
            final["graph"] = graph

        def be(gm, ex):
            compiled = _compile(gm, ex, opts, manager=PassManager(opts, observer=observe))
            g = final["graph"]
            out[name] = dict(all_reduce=sum(is_call(n, c10d.all_reduce.default) for n in g.nodes),
                             orphans=len(orphan_collectives(g)),
                             mm=sum(is_call(n, torch.ops.aten.mm.default) for n in g.nodes),
                             topk=sum(is_call(n, torch.ops.aten.topk.default) for n in g.nodes),
                             router_topk=sum(is_call(n, torch.ops.k3.router_topk.default) for n in g.nodes),
                             # expert ops reading int32 ids straight from k3::router_topk (no conversion)
                             experts_i32_ids=sum(is_call(n, *EXPERTS) and n.args[1].meta["val"].dtype == torch.int32
                                                 and is_call(n.args[1].args[0], torch.ops.k3.router_topk.default)
                                                 for n in g.nodes),
                             id_converts=sum(is_call(n, torch.ops.prims.convert_element_type.default,
                                                     torch.ops.aten._to_copy.default)
                                             and is_call(n.args[0], operator.getitem)
                                             and is_call(n.args[0].args[0], torch.ops.k3.router_topk.default)
                                             for n in g.nodes),
                             residual_norm_ar=sum(is_call(n, torch.ops.k3.residual_norm.default) and bool(n.args[7])
                                                  for n in g.nodes))
            return compiled
        torch._dynamo.reset()
        torch.compile(model, backend=be, fullgraph=True)(torch.zeros(2, 1, dtype=torch.long), model.new_cache(2))
    return out
