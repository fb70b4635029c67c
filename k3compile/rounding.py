"""Rounding orders: how a model rounds its RMSNorms and its AttnRes mixer's logits, as bits.

`patterns.graph.match_rms_norm` and `patterns.attnres` record them from the graph; the k3 ops take them as
their `rounding` / `mix_rounding` arguments; the ops' references (ops/reference.py) follow them and the
norm kernels (kernels/comm.py, `rnd_bits`) take the ones they can follow. 0 is the reference model's
order (model/functional.py). In bf16 the orders differ by up to one bf16 rounding of every element,
which the next layers amplify.
"""
# rounding (an RMSNorm of x with weight w, the normalisation in fp32):
NORM_CAST_FIRST = 1   # x * rsqrt(ms + eps) rounded to x.dtype, THEN times w (that product rounded again): the
                      # `weight * h.to(dtype)` of transformers-style modules. Else the weight is applied in fp32
                      # and the product rounded once (F.rms_norm / nn.RMSNorm in eager, the reference model).
NORM_DIV = 2          # x / sqrt(ms + eps)
NORM_RECIP = 4        # x * (1 / sqrt(ms + eps)), reciprocal of the sqrt; neither bit: x * rsqrt(ms + eps)
NORM_IN_DTYPE = 8     # every step in x.dtype (no fp32 upcast): each op rounds to it
NORM_BITS = NORM_CAST_FIRST | NORM_DIV | NORM_RECIP | NORM_IN_DTYPE
#
# mix_rounding (the mixer's logits and weighted sum): bits 0-3 are the per-source key norm's own
# rounding (the bits above; NORM_CAST_FIRST only matters with MIX_KEY_WEIGHTED), and
MIX_KEY_WEIGHTED = 16  # the key norm multiplies by w_norm itself (RMSNorm(src, w_norm)), the logit is that . w_qk;
                       # else the logit is RMSNorm(src) . (w_norm * w_qk), the query product taken in fp32 first
MIX_KEY_FP32 = 32      # the key is kept in fp32; else it is rounded to the model dtype before the dot product
MIX_DIV = 64           # mixed = sum_s e_s src_s / sum_s e_s with e_s = exp(logit_s - max) summed source by source
                       # (an unrolled mixer); else softmax(logits) first, then the weighted sum over the stack
MIX_SUM_FP32 = 128     # the mixed row goes into the output norm in fp32 (vLLM's AttnRes kernel); else it is rounded
                       # to the sources' dtype first
MIX_BITS = NORM_BITS | MIX_KEY_WEIGHTED | MIX_KEY_FP32 | MIX_DIV | MIX_SUM_FP32
