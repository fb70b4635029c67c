from .base import K3Pass


class ShardRouterLatent(K3Pass):
    name = "shard_router_latent"

    def expected(self, info):
        return len(info.experts)

    def run(self, graph, info, opts, report):
        raise NotImplementedError("shard_router_latent: not written yet")
