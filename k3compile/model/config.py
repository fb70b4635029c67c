"""K3Config: the Kimi K3 text-decoder hyper-parameters (../shared/K3-SPEC.md, section 1).

`K3Config.kimi_k3()` holds the published numbers; `tiny()` and `small()` keep every structural
feature (KDA and MLA layers, a dense layer 0, AttnRes blocks, LatentMoE with latent < hidden,
top-k < experts, a shared expert, MXFP4 experts) at widths that run on a laptop CPU. Every preset
is bfloat16 unless given `dtype=` (the fused ops take bfloat16 by default: K3Options.dtypes).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class K3Config:
    name: str = "custom"
    hidden: int = 7168
    num_layers: int = 93
    vocab: int = 163840
    rms_eps: float = 1e-5
    # KDA (linear attention)
    kda_heads: int = 96
    kda_head_dim: int = 128
    kda_conv: int = 4
    kda_gate_lower: float = -5.0
    kda_f_rank: int = 128
    # MLA (full attention)
    mla_heads: int = 96
    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    # dense layer(s): 0-indexed layer ids with a dense SiTU MLP instead of LatentMoE
    dense_layers: tuple[int, ...] = (0,)
    dense_inter: int = 33792
    # LatentMoE
    num_experts: int = 896
    top_k: int = 16
    expert_inter: int = 3072
    latent: int = 3584
    shared_inter: int = 6144
    routed_scaling: float = 1.0
    # SiTU
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # AttnRes
    attnres_block: int = 12
    attnres_max_blocks: int = 8
    # MLA layer placement: 1-indexed every `mla_every`-th layer and the last one
    mla_every: int = 4
    dtype: str = "bfloat16"
    max_seq: int = 4096
    seed: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    # ---------------------------------------------------------------- presets
    @classmethod
    def kimi_k3(cls, **kw) -> "K3Config":
        return cls(name="kimi_k3", **kw)

    @classmethod
    def tiny(cls, **kw) -> "K3Config":
        base = dict(
            name="tiny", hidden=64, num_layers=8, vocab=256,
            kda_heads=4, kda_head_dim=16, kda_f_rank=8,
            mla_heads=4, q_lora=32, kv_lora=32, qk_nope=16, qk_rope=8, v_head=16,
            dense_inter=128, num_experts=8, top_k=2, expert_inter=64, latent=32,
            shared_inter=64, attnres_block=3, max_seq=64,
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def small(cls, **kw) -> "K3Config":
        base = dict(
            name="small", hidden=256, num_layers=12, vocab=1024,
            kda_heads=8, kda_head_dim=32, kda_f_rank=16,
            mla_heads=8, q_lora=64, kv_lora=64, qk_nope=32, qk_rope=16, v_head=32,
            dense_inter=512, num_experts=32, top_k=4, expert_inter=128, latent=128,
            shared_inter=256, attnres_block=4, max_seq=128,
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def preset(cls, name: str, **kw) -> "K3Config":
        presets = {"tiny": cls.tiny, "small": cls.small, "kimi_k3": cls.kimi_k3}
        if name not in presets:
            raise ValueError(f"unknown K3 config {name!r}; choose one of {sorted(presets)}")
        return presets[name](**kw)

    # ---------------------------------------------------------------- derived
    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def is_mla(self, layer: int) -> bool:
        return (layer + 1) % self.mla_every == 0 or layer == self.num_layers - 1

    def is_dense(self, layer: int) -> bool:
        return layer in self.dense_layers

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_mla(i)]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_mla(i)]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_dense(i)]

    def writes_block(self, layer: int) -> bool:
        """AttnRes: layer i (i > 0, i % block == 0) stores the residual entering it as a block."""
        return layer > 0 and layer % self.attnres_block == 0

    def blocks_before(self, layer: int) -> int:
        """How many AttnRes blocks exist when layer `layer` starts (before it writes its own)."""
        return min(sum(1 for j in range(1, layer) if self.writes_block(j)), self.attnres_max_blocks)

    def check_tp(self, tp: int) -> None:
        """Raise ValueError if `tp` does not divide every sharded dimension."""
        if tp < 1:
            raise ValueError(f"TP size must be >= 1, got {tp}")
        dims = {
            "kda_heads": self.kda_heads, "mla_heads": self.mla_heads, "hidden": self.hidden,
            "expert_inter": self.expert_inter, "shared_inter": self.shared_inter,
            "dense_inter": self.dense_inter,
        }
        bad = {k: v for k, v in dims.items() if v % tp}
        if bad:
            raise ValueError(f"TP size {tp} does not divide {', '.join(f'{k}={v}' for k, v in bad.items())} "
                             f"of config {self.name!r}")
        if (self.expert_inter // tp) % 32:
            raise ValueError(f"TP size {tp}: per-rank expert intermediate {self.expert_inter // tp} "
                             f"is not a multiple of the MXFP4 block (32)")
        if self.latent % 32:
            raise ValueError(f"latent {self.latent} is not a multiple of the MXFP4 block (32)")

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return json.dumps(d, sort_keys=True)
