"""CUDA implementations of `k3::` ops. So far: the side-stream shared expert and its join.
The fused GEMM + communication kernels come with the GPU lowering."""
from ..model.functional import situ_mlp
from ..runtime import streams
from .registry import register


@register("shared_expert_async", "cuda", "side_stream")
def _shared_expert_async(x, w_gate_up, w_down, beta, linear_beta):
    return streams.fork(situ_mlp, x, w_gate_up, w_down, beta, linear_beta)


@register("stream_join", "cuda", "event_wait")
def _stream_join(x, after):
    streams.join(x)
    return x.clone()
