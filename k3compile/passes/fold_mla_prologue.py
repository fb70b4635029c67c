"""fold_mla_prologue: the MLA decode step's kv_a RMSNorm (and the q_rope copy) folded into its attention kernel.

Matches, once per MLA layer at decode (anchored on each auto-functionalized k3model::mla_decode):
    kv_new = cat([rms_norm(KVa[:, :L], w_kv, eps), KVa[:, L:]], -1)     KVa: the kv_a columns of qkv_a
    q_rope = contiguous(Q[..., nope:])                                 (optional: the model's copy)
    o      = k3model::mla_decode(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale)   (mutates kv_cache)
(`patterns.mla` has the ATen forms.)
Emits, in the same auto_functionalized node (so the cache update stays functionalised):
    o      = k3::mla_decode_normed(q_lat, Q[..., nope:], KVa, w_kv, eps, kv_cache, seq_lens, scale)
whose CUDA path is the Triton MLA decode (kernels/triton_mla.py) normalising the new token's latent
in its split kernel (every split program recomputes the [L] row's norm: 512 values) and reading
q_rope through its strides: Inductor's norm kernel, its cat kernel and its q_rope copy kernel go.
The reference is the matched math followed by the model's own mla_decode: on CPU the rewritten
graph equals the original exactly; on CUDA the norm's fp32 sum runs in another order (the cache
row can differ by one bf16 rounding step in a few elements).
Near-miss: a kv_new that is not that cat of one kv_a's normalised latent and its rope key (the
step where it differs: no RMSNorm, a norm without its [L] weight, other column ranges, kv_a not
unit-stride). A q_rope that is not a contiguous copy is passed as it is (not a near-miss).
Skipped: model dtype / TP size not supported, static M outside the pass's batch range; on CUDA with
Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py). Prefill (mla_prefill, T > 1 tokens) is left as it is.
"""
from __future__ import annotations

from ..ops import OPS
from ..patterns.graph import Fail
from ..patterns.mla import match_mla_prologue
from ..patterns.structure import op_name
from .base import K3Pass
from .pipeline import register
from .common import retarget_functionalized

_MLA_DECODE = "k3model::mla_decode"


@register
class FoldMlaPrologue(K3Pass):
    name = "fold_mla_prologue"
    core = "MLA"   # rewrites the reference model's MLA attention-core op: skipped (with a reason) without it
    description = "MLA decode prologue (kv_a RMSNorm + cat, q_rope copy) + attention -> k3::mla_decode_normed"
    pattern = "mla_decode(q_lat, contiguous(q_rope), cat(rms_norm(kv_a[:, :L]), kv_a[:, L:]), cache) (per MLA decode layer)"
    emits = "k3::mla_decode_normed, in place of mla_decode"

    def expected(self, info):
        return sum(op_name(n) == _MLA_DECODE for n in info.attention)

    def run(self, graph, info, opts, report):
        cores = [n for n in info.attention if op_name(n) == _MLA_DECODE]
        copies = 0
        for node, s in self.collect(cores, self.match, report):
            kw = {k: v for k, v in node.kwargs.items() if k not in ("q_lat", "q_rope", "kv_new", "seq_lens", "scale")}
            retarget_functionalized(node, OPS["mla_decode_normed"], dict(
                q_lat=node.kwargs["q_lat"], q_rope=s.q_rope, kv_a=s.kv_a, kv_norm_w=s.kv_norm_w, eps=s.eps,
                seq_lens=node.kwargs["seq_lens"], scale=node.kwargs["scale"], **kw,
                **({"rounding": s.rounding} if s.rounding else {})))
            copies += s.copy_dropped
            report.matched += 1
        if copies:
            report.notes.append(f"{copies} q_rope copy(ies) dropped (k3::mla_decode_normed reads the strided view)")

    @staticmethod
    def match(node):
        if not node.args or getattr(node.args[0], "_schema", None) is None:
            return Fail(node, "mla_decode is not an auto-functionalized call (already reinplaced?)")
        s = match_mla_prologue(node)
        return s if isinstance(s, Fail) else (node, s)
