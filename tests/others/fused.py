"""Kimi K3 decoder, research / fused style (written from /work/shared/K3-SPEC.md only).

Spellings on purpose:
  * One class holding per-layer dicts of pre-fused weights; GEMMs as torch.mm on reshaped 2-D views
    (`torch.mm(x.reshape(-1, K), W.t())`).
  * KDA: ONE fused in_proj [q; k; v; g; beta; f_a] (beta/f_a rows at the end) split with torch.split;
    one concatenated conv state [M, 3C, W-1] and conv weight; L2 norm via torch.linalg.vector_norm
    and clamp_min; the recurrence IN PLACE on the cached fp32 state (mul_, add_ of a matmul outer
    product).
  * MLA: one fused qkv_a [q_a; kv_a; gate shard]; W_UK / W_UV pre-split at load; new latent written
    with scatter_; scores as torch.baddbmm(rope_scores, q_lat, c_kv^T); masked_fill; softmax.
  * Dense MLP and shared expert: one fused [gate; up] weight, chunk(2, -1).
  * Router + latent down: ONE bf16 GEMM over [W_r; W_down], split, router logits .float() (so the
    router logits are bf16-rounded before the fp32 sigmoid).
  * RMSNorm by hand: fp32 upcast, `x / torch.sqrt(var + eps)`, weight multiplied in fp32 BEFORE the
    cast back to the input dtype.
  * AttnRes: a preallocated block buffer in the cache; `updated` is copied into the next free slot
    and the mixer reads buf[:n+1] (einsum logits, softmax(0), einsum weighted sum); residual as an
    in-place prefix.add_(delta).
  * Routed experts: an opaque grouped MXFP4 GEMM custom op (fusedk3::mxfp4_grouped_mm) called twice
    (W13 then W2) on [M*top_k, K] rows with SiTU between them in the graph; finalize via
    torch.einsum('mk,mkd->md', w, out).
  * Latent tail: `final.narrow(1, lo, H/t).add_(tail)`.
  * Collectives: in-place torch.distributed.all_reduce(t) on a tensor that is then used.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import weights as K3W


def tiny_config(**overrides) -> K3W.K3TinyConfig:
    return K3W.tiny_config(**overrides)


# ------------------------------------------------------------------------------------------------
# grouped MXFP4 GEMM custom op
# ------------------------------------------------------------------------------------------------

_FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _mxfp4_grouped_mm_impl(x: torch.Tensor, expert_ids: torch.Tensor, w: torch.Tensor,
                           w_scale: torch.Tensor) -> torch.Tensor:
    """y[r] = W[expert_ids[r]] @ x[r]; x [R, K], expert_ids [R], w [E, N, K/2] uint8 (E2M1, low nibble
    first), w_scale [E, N, K/32] uint8 (E8M0). Returns [R, N] in x.dtype (fp32 accumulation)."""
    mag = torch.tensor(_FP4, dtype=torch.float32)
    codes = w[expert_ids]                                                 # [R, N, K/2]
    nib = torch.empty(*codes.shape[:-1], codes.shape[-1], 2, dtype=torch.uint8)
    nib[..., 0] = codes & 0xF
    nib[..., 1] = codes >> 4
    nib = nib.flatten(-2).long()                                          # [R, N, K]
    val = mag[nib & 7] * (1 - 2 * (nib >> 3)).float()                     # sign bit = bit 3
    exps = w_scale[expert_ids].long() - 127
    scale = torch.ldexp(torch.ones(exps.shape, dtype=torch.float32), exps)   # [R, N, K/32]
    val = val * scale.repeat_interleave(32, dim=-1)
    return torch.bmm(val, x.float().unsqueeze(-1)).squeeze(-1).to(x.dtype)


def _mxfp4_grouped_mm_fake(x, expert_ids, w, w_scale):
    return x.new_empty(x.shape[0], w.shape[1])


def _register_mxfp4_grouped_mm():
    try:        # this file imported twice under two module names: keep the first registration
        return getattr(torch.ops.fusedk3, "mxfp4_grouped_mm")
    except (AttributeError, RuntimeError):
        op = torch.library.custom_op("fusedk3::mxfp4_grouped_mm", _mxfp4_grouped_mm_impl, mutates_args=())
        op.register_fake(_mxfp4_grouped_mm_fake)
        return op


mxfp4_grouped_mm = _register_mxfp4_grouped_mm()


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _rmsnorm(x, weight, eps):
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return (weight.float() * (xf / torch.sqrt(var + eps))).to(x.dtype)


def _mm(x, w):
    """x [..., K] @ w[N, K]^T via a 2-D view."""
    return torch.mm(x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], w.shape[0])


def _situ(gu, beta, lin_beta):
    gate, up = gu.float().chunk(2, dim=-1)
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (lin_beta * torch.tanh(up / lin_beta))


class FusedK3Cache:
    def __init__(self, conv, state, kv, pos, blocks):
        self.conv, self.state, self.kv, self.pos, self.blocks = conv, state, kv, pos, blocks


class FusedK3:
    def __init__(self, cfg: K3W.K3TinyConfig, rank: int, world: int, group, dtype):
        self.cfg, self.rank, self.world, self.dtype = cfg, rank, world, dtype
        self.group = group
        self.eps = cfg.rms_norm_eps
        self._pack(K3W.full_weights(cfg, dtype))

    # -- collectives ---------------------------------------------------------------------------
    def _allreduce_(self, t):
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t

    # -- weights -------------------------------------------------------------------------------
    def _pack(self, full):
        cfg, r, t = self.cfg, self.rank, self.world

        def rows(x):
            return x.chunk(t, 0)[r]

        def cols(x):
            return x.chunk(t, 1)[r]

        def mix(p):
            return (full[f"{p}.w_norm"], full[f"{p}.w_qk"], full[f"{p}.g"])

        def gate_up(x):
            g, u = x.chunk(2, 0)
            return torch.cat([rows(g), rows(u)])

        self.embed = full["embed"]
        self.lm_head = full["lm_head"]
        self.final_mix = mix("final")
        self.layers = []
        for li, kind in enumerate(cfg.layer_types):
            p = f"layers.{li}"
            L = {"kind": kind, "pre": mix(f"{p}.pre"), "post": mix(f"{p}.post"),
                 "dense": cfg.is_dense(li), "write": cfg.writes_block(li)}
            if kind == "kda":
                L["in_proj"] = torch.cat([rows(full[f"{p}.{n}"]) for n in ("q", "k", "v", "g", "beta")]
                                         + [full[f"{p}.f_a"]]).contiguous()
                L["f_b"] = rows(full[f"{p}.f_b"]).contiguous()
                L["conv"] = torch.cat([rows(full[f"{p}.conv_{n}"]) for n in "qkv"]).contiguous()
                L["A"] = rows(full[f"{p}.A_log"]).exp().contiguous()
                L["dt_bias"] = rows(full[f"{p}.dt_bias"]).contiguous()
                L["o_norm"] = full[f"{p}.o_norm"]
                L["o_proj"] = cols(full[f"{p}.o_proj"]).contiguous()
            else:
                nh = cfg.mla_num_heads // t
                L["qkv_a"] = torch.cat([full[f"{p}.q_a"], full[f"{p}.kv_a"], rows(full[f"{p}.gate"])]).contiguous()
                L["q_a_norm"] = full[f"{p}.q_a_norm"]
                L["kv_a_norm"] = full[f"{p}.kv_a_norm"]
                L["q_b"] = rows(full[f"{p}.q_b"]).contiguous()
                kv_b = rows(full[f"{p}.kv_b"]).reshape(nh, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
                L["w_uk"] = kv_b[:, :cfg.qk_nope_head_dim].contiguous()        # [nh, nope, C]
                L["w_uv_t"] = kv_b[:, cfg.qk_nope_head_dim:].transpose(1, 2).contiguous()   # [nh, C, v]
                L["o_proj"] = cols(full[f"{p}.o_proj"]).contiguous()
            if L["dense"]:
                L["gate_up"] = gate_up(full[f"{p}.mlp.gate_up"]).contiguous()
                L["down"] = cols(full[f"{p}.mlp.down"]).contiguous()
            else:
                L["router_down"] = torch.cat([full[f"{p}.router"], full[f"{p}.lat_down"]]).contiguous()
                L["bias"] = full[f"{p}.router_bias"]
                L["lat_norm"] = full[f"{p}.lat_norm"]
                L["lat_up"] = rows(full[f"{p}.lat_up"]).contiguous()
                for n in ("w13", "w13_scale"):
                    g, u = full[f"{p}.{n}"].chunk(2, 1)
                    L[n] = torch.cat([g.chunk(t, 1)[r], u.chunk(t, 1)[r]], 1).contiguous()
                for n in ("w2", "w2_scale"):
                    L[n] = full[f"{p}.{n}"].chunk(t, 2)[r].contiguous()
                L["gate_up"] = gate_up(full[f"{p}.shared.gate_up"]).contiguous()
                L["down"] = cols(full[f"{p}.shared.down"]).contiguous()
            self.layers.append(L)

    def new_cache(self, batch: int) -> FusedK3Cache:
        cfg, r, t = self.cfg, self.rank, self.world
        full = K3W.full_cache(cfg, batch, self.dtype)
        conv, state, kv = {}, {}, {}
        for li, kind in enumerate(cfg.layer_types):
            p = f"layers.{li}"
            if kind == "kda":
                conv[li] = torch.cat([full[f"{p}.conv_{n}"].chunk(t, 1)[r] for n in "qkv"], 1).contiguous()
                state[li] = full[f"{p}.state"].chunk(t, 1)[r].contiguous()
            else:
                kv[li] = full[f"{p}.kv"].clone()
        blocks = torch.zeros(cfg.n_blocks() + 1, batch, cfg.hidden_size, dtype=self.dtype)
        return FusedK3Cache(conv, state, kv, full["pos"].clone(), blocks)

    # -- AttnRes -------------------------------------------------------------------------------
    def _mix(self, prefix, delta, n, buf, params, write):
        w_norm, w_qk, g = params
        if delta is not None:
            prefix.add_(delta)                   # the residual add, in place
        if n == 0:
            mixed = prefix
        else:
            buf[n].copy_(prefix)
            src = buf[: n + 1]                                              # [n+1, M, H]
            logits = torch.einsum("smh,h->sm", _rmsnorm(src, w_norm, self.eps).float(), w_qk.float())
            mixed = torch.einsum("sm,smh->mh", logits.softmax(0), src.float()).to(prefix.dtype)
        if write:
            buf[n].copy_(prefix)
            n += 1
        return _rmsnorm(mixed, g, self.eps), n

    # -- attention -----------------------------------------------------------------------------
    def _kda(self, x, L, li, cache):
        cfg = self.cfg
        M = x.shape[0]
        nh, d = cfg.kda_num_heads // self.world, cfg.kda_head_dim
        C = nh * d
        q, k, v, g, b, fa = torch.split(_mm(x, L["in_proj"]), [C, C, C, C, nh, cfg.kda_gate_rank], dim=-1)
        conv_state = cache.conv[li]                                         # [M, 3C, W-1]
        window = torch.cat([conv_state, torch.cat([q, k, v], -1).unsqueeze(-1)], dim=-1)
        conv_state.copy_(window[..., 1:])
        qkv = F.silu((window.float() * L["conv"].float()).sum(-1)).to(x.dtype)
        q, k, v = (t.float().reshape(M, nh, d) for t in qkv.split(C, dim=-1))
        q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True).clamp_min(cfg.l2norm_eps ** 0.5)
        q = q * d ** -0.5
        k = k / torch.linalg.vector_norm(k, dim=-1, keepdim=True).clamp_min(cfg.l2norm_eps ** 0.5)

        f = _mm(fa, L["f_b"]).float().reshape(M, nh, d) + L["dt_bias"].reshape(nh, d)
        decay = torch.exp(cfg.kda_gate_lower_bound * torch.sigmoid(L["A"].reshape(nh, 1) * f))
        beta = b.float().sigmoid()

        S = cache.state[li]                                                 # [M, nh, dv, dk] fp32
        S.mul_(decay.unsqueeze(2))
        err = v - torch.matmul(S, k.unsqueeze(-1)).squeeze(-1)
        S.add_(torch.matmul((beta.unsqueeze(-1) * err).unsqueeze(-1), k.unsqueeze(-2)))
        o = torch.matmul(S, q.unsqueeze(-1)).squeeze(-1)                     # [M, nh, dv]
        o = _rmsnorm(o.to(x.dtype), L["o_norm"], self.eps) * torch.sigmoid(g).reshape(M, nh, d)
        return self._allreduce_(_mm(o.reshape(M, C), L["o_proj"]))

    def _mla(self, x, L, li, cache):
        cfg = self.cfg
        M = x.shape[0]
        nh = cfg.mla_num_heads // self.world
        C, R, NOPE, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        q_a, ckv, kpe, gate = _mm(x, L["qkv_a"]).split([cfg.q_lora_rank, C, R, nh * V], dim=-1)
        q = _mm(_rmsnorm(q_a, L["q_a_norm"], self.eps), L["q_b"]).reshape(M, nh, NOPE + R)
        ckv = _rmsnorm(ckv, L["kv_a_norm"], self.eps)

        kv = cache.kv[li]                                                   # [M, T, C+R]
        pos = cache.pos
        kv.scatter_(1, pos.view(M, 1, 1).expand(M, 1, C + R), torch.cat([ckv, kpe], -1).unsqueeze(1))

        q_lat = torch.bmm(q[..., :NOPE].transpose(0, 1), L["w_uk"]).transpose(0, 1)    # [M, nh, C]
        kvf = kv.float()
        rope_scores = torch.bmm(q[..., NOPE:].float(), kvf[..., C:].transpose(1, 2))     # [M, nh, T]
        scores = torch.baddbmm(rope_scores, q_lat.float(), kvf[..., :C].transpose(1, 2))
        scores = scores * (NOPE + R) ** -0.5
        T = kv.shape[1]
        future = torch.arange(T, device=pos.device).view(1, 1, T) > pos.view(M, 1, 1)
        p = scores.masked_fill(future, float("-inf")).softmax(-1)
        o_lat = torch.bmm(p, kvf[..., :C]).to(x.dtype)                      # [M, nh, C]
        o = torch.bmm(o_lat.transpose(0, 1), L["w_uv_t"]).transpose(0, 1)   # [M, nh, V]
        o = o * torch.sigmoid(gate).reshape(M, nh, V)
        return self._allreduce_(_mm(o.reshape(M, nh * V), L["o_proj"]))

    # -- MLP / MoE -----------------------------------------------------------------------------
    def _dense(self, x, L):
        h = _situ(_mm(x, L["gate_up"]), self.cfg.situ_beta, self.cfg.situ_linear_beta).to(x.dtype)
        return self._allreduce_(_mm(h, L["down"]))

    def _moe(self, x, L):
        cfg = self.cfg
        M, H = x.shape
        E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
        router_logits, lat = _mm(x, L["router_down"]).split([E, cfg.moe_latent_size], dim=-1)
        scores = router_logits.float().sigmoid()
        ids = (scores + L["bias"]).topk(K, dim=-1).indices
        w = scores.gather(-1, ids)
        w = w * (cfg.routed_scaling_factor / (w.sum(-1, keepdim=True) + cfg.router_renorm_eps))

        rows = lat.repeat_interleave(K, dim=0)                              # [M*K, L]
        flat_ids = ids.reshape(-1)
        ug = torch.ops.fusedk3.mxfp4_grouped_mm(rows, flat_ids, L["w13"], L["w13_scale"])
        mid = _situ(ug, cfg.situ_beta, cfg.situ_linear_beta).to(x.dtype)
        out = torch.ops.fusedk3.mxfp4_grouped_mm(mid, flat_ids, L["w2"], L["w2_scale"]).view(M, K, -1)
        routed = torch.einsum("mk,mkd->md", w, out.float()).to(x.dtype)
        self._allreduce_(routed)
        tail = _mm(_rmsnorm(routed, L["lat_norm"], self.eps), L["lat_up"])  # [M, H/t]

        final = _mm(_situ(_mm(x, L["gate_up"]), cfg.situ_beta, cfg.situ_linear_beta).to(x.dtype), L["down"])
        hs = H // self.world
        final.narrow(1, self.rank * hs, hs).add_(tail)
        return self._allreduce_(final)

    # -- decode step ---------------------------------------------------------------------------
    def step(self, ids: torch.Tensor, cache: FusedK3Cache) -> torch.Tensor:
        prefix = F.embedding(ids, self.embed)
        delta = None
        n = 0
        for li, L in enumerate(self.layers):
            x, n = self._mix(prefix, delta, n, cache.blocks, L["pre"], L["write"])
            if L["kind"] == "kda":
                a = self._kda(x, L, li, cache)
            else:
                a = self._mla(x, L, li, cache)
            x, n = self._mix(prefix, a, n, cache.blocks, L["post"], False)
            delta = self._dense(x, L) if L["dense"] else self._moe(x, L)
        x, _ = self._mix(prefix, delta, n, cache.blocks, self.final_mix, False)
        cache.pos.add_(1)
        return torch.mm(x, self.lm_head.t()).float()


def build(config=None, rank: int = 0, world: int = 1, group=None, dtype=torch.bfloat16) -> FusedK3:
    cfg = config or tiny_config()
    K3W.check_world(cfg, world)
    if world > 1 and group is None:
        group = dist.group.WORLD
    return FusedK3(cfg, rank, world, group, dtype)
