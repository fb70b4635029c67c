"""K3Model: embedding, decoder layers, final AttnRes norm, LM head; cache and decode API."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import K3Config
from .layers import AttnRes, DecoderLayer, WeightFactory
from .tp import TPInfo


class K3Cache:
    """Per-sequence decode state for a batch of M sequences on one TP rank.

    conv[i], state[i]: KDA layer i's short-conv inputs [M, 3*C, conv-1] and fp32 recurrent state
    [M, H_r, K, V]; kv[i]: MLA layer i's latent KV cache [M, max_seq, kv_lora + qk_rope];
    seq_lens: tokens already cached per sequence [M] (int64).
    """

    def __init__(self, cfg: K3Config, batch: int, tp: TPInfo | None = None, device=None, max_seq: int | None = None):
        tp = tp or TPInfo()
        if batch < 1:
            raise ValueError(f"cache batch must be >= 1, got {batch}")
        self.cfg, self.batch, self.tp_size = cfg, batch, tp.size
        self.max_seq = max_seq or cfg.max_seq
        dt = cfg.torch_dtype
        Hr = cfg.kda_heads // tp.size
        C = 3 * Hr * cfg.kda_head_dim
        self.conv: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}
        self.kv: dict[int, torch.Tensor] = {}
        for i in range(cfg.num_layers):
            if cfg.is_mla(i):
                self.kv[i] = torch.zeros(batch, self.max_seq, cfg.kv_lora + cfg.qk_rope, dtype=dt, device=device)
            else:
                self.conv[i] = torch.zeros(batch, C, cfg.kda_conv - 1, dtype=dt, device=device)
                self.state[i] = torch.zeros(batch, Hr, cfg.kda_head_dim, cfg.kda_head_dim,
                                            dtype=torch.float32, device=device)
        self.seq_lens = torch.zeros(batch, dtype=torch.int64, device=device)
        # The cache is written in place every step. Marking its tensors static lets CUDA graphs
        # (torch.compile mode="reduce-overhead") capture those writes instead of refusing to graph.
        for t in self.tensors():
            torch._dynamo.mark_static_address(t, guard=False)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.conv.values(), *self.state.values(), *self.kv.values(), self.seq_lens]

    def check(self, cfg: K3Config, tp: TPInfo, batch: int, T: int) -> None:
        """Raise ValueError if this cache does not fit the model and batch. Traced under torch.compile (the
        same errors as eager, not a shape error deep in a layer), except the config comparison: a changed
        config field becomes a symbolic int there, which a dataclass comparison cannot take."""
        if not torch.compiler.is_compiling() and self.cfg != cfg:
            raise ValueError(f"cache was made for config {self.cfg.name!r}, the model has config {cfg.name!r} "
                             f"(or a variant of it): make a new cache with K3Cache(model.cfg, ...)")
        if self.tp_size != tp.size:
            raise ValueError(f"cache was made for TP={int(self.tp_size)}, the model runs TP={tp.size}")
        held = self.seq_lens.shape[0]  # == self.batch
        # traced with a symbolic batch (dynamic shapes), comparing would specialise it: checked where static
        if isinstance(held, int) and isinstance(batch, int) and held != batch:
            raise ValueError(f"cache holds {held} sequences, token_ids has batch {batch}")


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config, tp: TPInfo | None = None, device=None, meta: bool = False,
                 layers: list[int] | None = None):
        """layers: build only these layer ids (e.g. one real-size layer on the meta device)."""
        super().__init__()
        tp = tp or TPInfo()
        cfg.check_tp(tp.size)
        self.cfg, self.tp = cfg, tp
        wf = WeightFactory(cfg, tp, device=device, meta=meta)
        ids = range(cfg.num_layers) if layers is None else layers
        self.embed = wf.param(wf.full("embed", (cfg.vocab, cfg.hidden), std=1.0))
        self.layers = nn.ModuleDict({str(i): DecoderLayer(wf, i) for i in ids})
        self.final_res = AttnRes(wf, "final_res")
        self.lm_head = wf.linear("lm_head", cfg.vocab, cfg.hidden)

    def new_cache(self, batch: int, max_seq: int | None = None) -> K3Cache:
        return K3Cache(self.cfg, batch, self.tp, device=self.embed.device, max_seq=max_seq)

    def forward(self, token_ids: torch.Tensor, cache: K3Cache) -> torch.Tensor:
        """One step over T new tokens per sequence: token_ids [M, T] -> last-token logits [M, vocab].

        T == 1 is decode; T > 1 is prefill. Mutates the cache. Static checks only (it is traced);
        `decode`/`prefill` also check token ids against the vocabulary.
        """
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must be [M, T], got shape {tuple(token_ids.shape)}")
        if token_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"token_ids must be int64 or int32, got {token_ids.dtype}")
        M, T = token_ids.shape
        cache.check(self.cfg, self.tp, M, T)  # traced too: under torch.compile the same ValueError as eager
        prefix = F.embedding(token_ids.reshape(-1), self.embed)
        delta, blocks = None, []
        for layer in self.layers.values():
            prefix, delta = layer(prefix, delta, blocks, cache, M, T)
        x, _ = self.final_res(prefix, delta, blocks)
        x = x.view(M, T, -1)[:, -1]
        cache.seq_lens.add_(T)
        return F.linear(x, self.lm_head).float()

    def _check_ids(self, token_ids: torch.Tensor, cache: K3Cache) -> None:
        cache.check(self.cfg, self.tp, token_ids.shape[0], token_ids.shape[-1] if token_ids.dim() == 2 else 1)
        if token_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"token_ids must be int64 or int32, got {token_ids.dtype}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.cfg.vocab):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab}); got min {int(token_ids.min())}, "
                             f"max {int(token_ids.max())}")
        T = token_ids.shape[-1] if token_ids.dim() == 2 else 1
        free = cache.max_seq - int(cache.seq_lens.max())
        if T > free:
            raise ValueError(f"cache is full: {T} new tokens but room for {free} (max_seq={cache.max_seq})")

    def decode(self, token_ids: torch.Tensor, cache: K3Cache) -> torch.Tensor:
        """token_ids [M] (one new token per sequence) -> logits [M, vocab]. Goes through
        `self(...)`, so `model.compile(backend="k3")` compiles it."""
        if token_ids.dim() != 1:
            raise ValueError(f"decode takes token_ids of shape [M], got {tuple(token_ids.shape)}")
        self._check_ids(token_ids, cache)
        return self(token_ids[:, None], cache)

    def prefill(self, token_ids: torch.Tensor, cache: K3Cache) -> torch.Tensor:
        """token_ids [M, T] -> last-token logits [M, vocab]; fills the cache."""
        if token_ids.dim() != 2:
            raise ValueError(f"prefill takes token_ids of shape [M, T], got {tuple(token_ids.shape)}")
        self._check_ids(token_ids, cache)
        return self(token_ids, cache)
