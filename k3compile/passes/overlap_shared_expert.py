from .base import K3Pass


class OverlapSharedExpert(K3Pass):
    name = "overlap_shared_expert"

    def expected(self, info):
        return len(info.experts)

    def run(self, graph, info, opts, report):
        raise NotImplementedError("overlap_shared_expert: not written yet")
