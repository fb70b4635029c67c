"""vLLM 0.33's own Kimi K3 model (`KimiLinearForCausalLM`) built on CPU, for tests/test_vllm_real.py.

The shims, each the least that lets the real model run without a GPU (nothing in vLLM is edited):
- `cpu_triton_backend()`: a Triton backend whose driver says "CUDA sm_90" and runs nothing (plus an inactive
  entry named "cpu", the name torch's `has_triton()` looks for without a GPU). vLLM only keeps real
  Triton where exactly one driver is active; with it, `@triton.jit` kernels stay
  `JITFunction`s, so Dynamo captures the AttnRes kernel as `triton_kernel_wrapper_functional` as it does
  on CUDA (Triton's CUDA compiler still makes the kernel's TTIR, which torch reads for its mutations).
  No kernel can run: K3's canonicalisation rewrites the launches into ATen ops before anything runs,
  and the uncompiled reference calls `attn_res_torch`, the kernel transcribed into PyTorch
  (`eager_attn_res`; Triton's interpreter did not run it here: the kernel calls `tl.cdiv`, a JIT function).
- `cuda_stubs()`: `torch.cuda.Stream()` / `Event()` need CUDA; the model only makes them for overlap.
  Under the stub they are None / inert, so every `maybe_execute_in_parallel` runs its two sides in order.
- `fused_kda_decode`: vLLM's `_C::fused_kda_decode` (the KDA decode step on SM90+), defined with the
  schema of vLLM 0.33's `_C` and a CPU implementation of the step's math (conv update + SiLU, q/k
  L2 norm, gate, delta rule, gated RMSNorm); the support check that needs an sm_90 device is patched
  to look for the op only.
- routed experts: vLLM's MoE oracle has no CPU kernel for SiTU; `reference_experts_cls()` computes them in
  PyTorch and the oracle is patched to pick it. On CPU vLLM calls the MoE runner's Python directly (Dynamo
  would trace the experts); the runner is set to call `vllm::moe_forward(_shared)` as it does on CUDA,
  so the graph holds the opaque op with its two outputs.
- the MLA layer (layer 2), on vLLM's own CPU attention backend (CPU_MLA, which vLLM picks on CPU):
  - `_C::mla_decode_kvcache` (that backend's decode, a kernel of vLLM's CPU build, which this CUDA wheel
    lacks) and `_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert` (the layer's decode query concat +
    latent cache insert, a CUDA kernel), each defined with vLLM 0.33's schema and a CPU implementation:
    the absorbed-MLA decode over the paged latent cache (softmax(q . [c | k_pe] * scale) . c), and the
    concat + insert (NoPE: no rotation). `decode_context` binds each MLA layer's cache and metadata.
  - `cpu_q_kv_rmsnorm()`: the layer's front-end `fused_q_kv_rmsnorm` (a Triton kernel through vLLM's JIT
    launcher) computes the kernel's math in PyTorch for CPU tensors (fp32, one cast at the store), so the
    CPU graph holds two RMSNorms in ATen where CUDA's holds the kernel (which no K3 pass reads). Dynamo
    does capture vLLM's launcher as `triton_kernel_wrapper_functional`, but Inductor on CPU (the plugin
    route) cannot compile a user Triton kernel.
  - Not a shim: the layer's core (`MultiHeadLatentAttention._attention`) is one op,
    `k3vllm::kimi_k3_mla_attention`, made by K3's vLLM hook (`opaque_kimi_k3_mla`, which the plugin runs
    and the op-by-op route calls): Dynamo cannot trace vLLM's Python for it (a transposed `out=`).
- `VLLM_TARGET_DEVICE=cpu` (vLLM's CPU platform, gloo) and `VLLM_KIMI_K3_GEMM_AR=0` (no CuTe GEMM-AR).
- `tail_tier(name)`: vLLM's CPU platform turns the shared-experts stream off, so at TP > 1 its latent-MoE
  runner always takes the column-parallel tail; the TP=2 tests pick each tail in turn, the one CUDA runs at
  decode sizes (the full replicated W_up, the shared partial all-reduced on its own) first.
"""
from __future__ import annotations

import contextlib
import json
import operator
import os
import tempfile

import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")


# ------------------------------------------------------------------ Triton: a CPU placeholder backend
def cpu_triton_backend() -> None:
    """Register (before vLLM imports Triton) a backend named `k3cpu` that borrows the CUDA compiler for
    TTIR and reports sm_90, so `triton.runtime.driver.active` exists on a machine without a GPU."""
    from triton.backends import Backend, backends
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.backends.nvidia.compiler import CUDABackend
    if "k3cpu" in backends:
        return

    class CpuPlaceholderDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def set_current_device(self, device):
            pass

        def get_device_capability(self, device=None):
            return (9, 0)

        def get_benchmarker(self):
            raise RuntimeError("the k3cpu Triton backend runs no kernel")

    class NoCompiler(CUDABackend):
        @staticmethod
        def supports_target(target):
            return False

    class InactiveDriver(CpuPlaceholderDriver):
        @classmethod
        def is_active(cls):
            return False

    backends.pop("nvidia", None)   # its compiler is ours now (make_backend wants one per target)
    backends["k3cpu"] = Backend(compiler=CUDABackend, driver=CpuPlaceholderDriver)
    # torch's has_triton() on a CPU-only machine asks for a backend named "cpu" (vLLM's check skips that name)
    backends["cpu"] = Backend(compiler=NoCompiler, driver=InactiveDriver)


def attn_res_torch(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx,
                   eps, output_norm_eps):
    """vLLM's `_attn_res_kernel` transcribed into PyTorch, line by line (fp32 math, the prefix-add rounded to
    the prefix dtype, prefix and blocks written in place) for the uncompiled reference on CPU."""
    updated = prefix.float()
    if delta is not None:
        updated = (updated + delta.float()).to(prefix.dtype).float()
        prefix.copy_(updated)
    if block_write_idx >= 0:
        blocks[:, block_write_idx].copy_(updated)
    if num_blocks == 0:
        mixed = updated
    else:
        w = norm_weight.float() * qk_weight.float()
        values = torch.cat([blocks[:, :num_blocks].float(), updated[:, None]], 1)      # [M, L+1, D]
        rstd = torch.rsqrt(values.pow(2).mean(-1) + eps)
        logits = (values * w).sum(-1) * rstd
        mixed = (torch.softmax(logits, -1)[..., None] * values).sum(1)
    out = mixed
    if output_norm_weight is not None:
        out = mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + output_norm_eps) * output_norm_weight.float()
    return out.to(prefix.dtype)


@contextlib.contextmanager
def eager_attn_res():
    """The uncompiled reference calls `attn_res_torch` where the model calls vLLM's `attn_res` (its Triton
    kernel needs a GPU; Triton's interpreter does not run it here)."""
    from vllm.models.kimi_k3.nvidia import model as mod
    orig = mod.attn_res
    mod.attn_res = attn_res_torch
    try:
        yield
    finally:
        mod.attn_res = orig


# ------------------------------------------------------------------ CUDA streams and events
class _Event:
    def __init__(self, *a, **k):
        pass
    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass


class _NoStream:
    """A type (annotations use `torch.cuda.Stream | None`) whose construction gives None."""
    def __new__(cls, *a, **k):
        return None


@contextlib.contextmanager
def cuda_stubs():
    """Streams are None and events inert; the device name / capability that vLLM's copy of
    flash-linear-attention reads at import (it takes the placeholder's "cuda" target for NVIDIA) say no GPU."""
    saved = {k: getattr(torch.cuda, k) for k in ("Stream", "Event", "get_device_name", "get_device_capability")}
    torch.cuda.Stream = _NoStream   # type: ignore[assignment,misc]
    torch.cuda.Event = _Event   # type: ignore[assignment,misc]
    torch.cuda.get_device_name = lambda *a, **k: "cpu"   # type: ignore[assignment]
    torch.cuda.get_device_capability = lambda *a, **k: (0, 0)   # type: ignore[assignment]
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(torch.cuda, k, v)


# ------------------------------------------------------------------ _C::fused_kda_decode on CPU
FUSED_KDA_DECODE_SCHEMA = (
    "fused_kda_decode(Tensor x, Tensor weight, Tensor? bias, Tensor! conv_state, Tensor raw_g, Tensor raw_beta, "
    "Tensor A_log, Tensor dt_bias, Tensor state_indices, Tensor! state, Tensor! out, float? lower_bound, "
    "Tensor? output_gate, Tensor? norm_weight, float norm_eps) -> ()")
_LIBS: list = []


def _fused_kda_decode_cpu(x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state,
                          out, lower_bound, output_gate, norm_weight, norm_eps):
    """One KDA decode token per row of x [M, 3*H*D]: the short conv over (conv_state, x) + SiLU, q/k L2 norm
    (q scaled by D^-0.5), gate `lower * sigmoid(exp(A_log) * (raw_g + dt_bias))` (log decay), beta = sigmoid,
    delta rule on the fp32 state, then RMSNorm(o) * norm_weight * sigmoid(output_gate)."""
    M, C = x.shape
    W = weight.shape[1]                              # weight: [3, W, H*D] (width-major decode copy)
    w = weight.permute(0, 2, 1).reshape(C, W).float()
    H, D = raw_g.shape[2], raw_g.shape[3]
    for i in range(M):
        s = int(state_indices[i])
        cs = conv_state[s]                           # [C, W-1] (dim-first) or [W-1, C]
        dim_first = cs.shape[0] == C
        hist = cs.float() if dim_first else cs.float().t()
        win = torch.cat([hist, x[i].float()[:, None]], 1)   # [C, W]
        y = (win * w).sum(1) + (bias.float() if bias is not None else 0)
        y = torch.nn.functional.silu(y).to(x.dtype).float()
        new_hist = win[:, 1:].to(cs.dtype)
        cs.copy_(new_hist if dim_first else new_hist.t())
        q, k, v = y.view(3, H, D).unbind(0)
        q = torch.nn.functional.normalize(q, dim=-1) * D ** -0.5
        k = torch.nn.functional.normalize(k, dim=-1)
        g = -torch.nn.functional.softplus(A_log.float().exp()[:, None] * (raw_g[0, i].float() + dt_bias.float().view(H, D))) \
            if lower_bound is None else \
            lower_bound * torch.sigmoid(A_log.float().exp()[:, None] * (raw_g[0, i].float() + dt_bias.float().view(H, D)))
        beta = torch.sigmoid(raw_beta[0, i].float())[:, None]       # [H, 1]
        S = state[s].float() * g.exp()[:, :, None]                   # [H, K, V]
        kv = torch.einsum("hk,hkv->hv", k, S)
        S = S + torch.einsum("hk,hv->hkv", k, beta * (v - kv))
        o = torch.einsum("hk,hkv->hv", q, S)
        state[s].copy_(S.to(state.dtype))
        if norm_weight is not None:
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight.float()
        if output_gate is not None:
            o = o * torch.sigmoid(output_gate[i].float().view(H, D))
        out[0, i].copy_(o.to(out.dtype))


# ------------------------------------------------------------------ the MLA layer's kernels on CPU
MLA_INSERT_SCHEMA = (
    "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert(Tensor ql_nope, Tensor q_pe, Tensor kv_c_normed, "
    "Tensor k_pe, Tensor! mqa_q, Tensor! k_cache, Tensor slot_mapping, int cache_block_size, "
    "Tensor? position_ids=None, Tensor? cos_sin_cache=None) -> ()")
MLA_DECODE_SCHEMA = ("mla_decode_kvcache(Tensor! out, Tensor query, Tensor kv_cache, float scale, "
                     "Tensor block_tables, Tensor seq_lens) -> ()")


def _mla_insert_cpu(ql_nope, q_pe, kv_c_normed, k_pe, mqa_q, k_cache, slot_mapping, cache_block_size,
                    position_ids=None, cos_sin_cache=None):
    """mqa_q = [ql_nope | q_pe]; each token's latent [kv_c_normed | k_pe] written at its slot (K3's MLA is
    NoPE: no rotation)."""
    assert position_ids is None and cos_sin_cache is None, "K3's MLA layers apply no RoPE"
    mqa_q.copy_(torch.cat([ql_nope, q_pe], -1))
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // cache_block_size, slot % cache_block_size].copy_(torch.cat([kv_c_normed[i], k_pe[i]]))


def _mla_decode_cpu(out, query, kv_cache, scale, block_tables, seq_lens):
    """Absorbed MLA decode over the paged latent cache: per sequence and head, softmax(q . [c | k_pe] * scale)
    over its seq_lens tokens, times their latents c (fp32 math)."""
    bs, lat = kv_cache.shape[1], out.shape[-1]
    for b in range(query.shape[0]):
        n = int(seq_lens[b])
        kv = kv_cache[block_tables[b, :(n + bs - 1) // bs].long()].reshape(-1, kv_cache.shape[-1])[:n].float()
        p = torch.softmax(query[b].float() @ kv.t() * scale, -1)
        out[b].copy_((p @ kv[:, :lat]).to(out.dtype))


def _rms_fp32(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def cpu_q_kv_rmsnorm() -> None:
    """The MLA layer's `fused_q_kv_rmsnorm` on CPU tensors: its Triton kernel's math (fp32, one cast at the
    store) in PyTorch; on another device vLLM's function."""
    from vllm.models.kimi_k3.nvidia import mla
    vllm_fn = mla.fused_q_kv_rmsnorm
    if getattr(vllm_fn, "_k3_cpu", False):
        return

    def fused_q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps):
        if qr.device.type != "cpu":
            return vllm_fn(qr, kv, q_weight, kv_weight, eps)
        return _rms_fp32(qr, q_weight, eps), _rms_fp32(kv, kv_weight, eps)

    fused_q_kv_rmsnorm._k3_cpu = True
    mla.fused_q_kv_rmsnorm = fused_q_kv_rmsnorm


def define_c_ops() -> None:
    if hasattr(torch.ops._C, "fused_kda_decode"):
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    for schema, impl in ((FUSED_KDA_DECODE_SCHEMA, _fused_kda_decode_cpu), (MLA_INSERT_SCHEMA, _mla_insert_cpu),
                         (MLA_DECODE_SCHEMA, _mla_decode_cpu)):
        name = schema.split("(")[0]
        lib.define(schema)
        lib.impl(name, impl, "CPU")
        lib.impl(name, lambda *a: None, "Meta")
    _LIBS.append(lib)


# ------------------------------------------------------------------ routed experts on CPU
def reference_experts_cls():
    """vLLM's unquantized MoE backend oracle finds no CPU kernel for SiTU (its CPU experts take SiLU / GELU
    and vLLM's `_C` CPU library); this modular-experts class computes the experts in PyTorch
    (W13 -> SiTU -> W2, weighted sum over top-k), and the oracle is patched to pick it."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    class ReferenceExperts(CPUUnquantizedExperts):
        @staticmethod
        def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
            return True, None

        def process_weights_after_loading(self, layer):
            self._use_zentorch = False

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            cfg = self.moe_config
            beta, lbeta = cfg.activation_situ_beta or 1.0, cfg.activation_situ_linear_beta
            x = hidden_states.float()
            acc = torch.zeros(output.shape, dtype=torch.float32)
            for j in range(topk_ids.shape[1]):
                for i in range(x.shape[0]):
                    e = int(topk_ids[i, j])
                    gu = (x[i] @ w1[e].float().t()).to(hidden_states.dtype).float()
                    gate, up = gu.chunk(2)
                    gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
                    if lbeta is not None:
                        up = lbeta * torch.tanh(up / lbeta)
                    mid = (gate * up).to(hidden_states.dtype).float()
                    acc[i] += float(topk_weights[i, j]) * (mid @ w2[e].float().t())
            output.copy_(acc.to(output.dtype))

    return ReferenceExperts


# ------------------------------------------------------------------ the tiny model
def tiny_config(tp: int = 1) -> dict:
    """Layers 0-1 KDA, layer 2 MLA (K3's q-LoRA, NoPE, sigmoid output gate; 4 heads per rank); layer 0
    dense, layers 1-2 LatentMoE (a shared expert, a latent norm; no intermediate padding at TP=2); AttnRes
    block 12 (layer 0 writes the one block). KDA heads 12 per rank (the native decode's smallest)."""
    return dict(
        model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], vocab_size=512, hidden_size=256,
        intermediate_size=512, num_hidden_layers=3, num_attention_heads=4 * tp, head_dim=64, hidden_act="situ",
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, rms_norm_eps=1e-5,
        moe_intermediate_size=256, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        first_k_dense_replace=1, moe_layer_freq=1, min_moe_intermediate_per_partition=64, use_grouped_topk=True, num_expert_group=1, topk_group=1,
        moe_router_activation_func="sigmoid", routed_expert_hidden_size=128, latent_moe_use_norm=True,
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [3], "head_dim": 128, "num_heads": 12 * tp,
                            "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        attn_res_block_size=12, torch_dtype="bfloat16", max_position_embeddings=256, tie_word_embeddings=False)


def vllm_config(tp: int = 1, compilation_config=None):
    from vllm.config import CacheConfig, CompilationConfig, ModelConfig, ParallelConfig, VllmConfig
    d = tempfile.mkdtemp(prefix="k3_kimi_tiny_")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(tiny_config(tp), f)
    mc = ModelConfig(model=d, tokenizer=d, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256)
    return VllmConfig(model_config=mc, cache_config=CacheConfig(mamba_block_size=256),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp),
                      compilation_config=compilation_config or CompilationConfig(),
                      additional_config={"kda_decode_backend": "native"})


def install_shims() -> None:
    from _vllm_ranks import register_c_stubs
    cpu_triton_backend()
    define_c_ops()
    register_c_stubs()   # the `_C` schemas vLLM's FixFunctionalizationPass names
    with cuda_stubs():
        from vllm.models.kimi_k3.nvidia import kda
    cpu_q_kv_rmsnorm()
    kda.is_fused_kda_decode_supported = lambda *a, **k: hasattr(torch.ops._C, "fused_kda_decode")
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as ufm
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    experts = reference_experts_cls()
    ufm.select_unquantized_moe_backend = lambda *a, **k: (UnquantizedMoeBackend.CPU, experts)
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    MoERunner._select_forward = lambda self: (torch.ops.vllm.moe_forward if self._shared_experts is None
                                              else torch.ops.vllm.moe_forward_shared)


def init_weights(model, seed: int) -> None:
    """Deterministic random weights: norms near 1, matrices uniform in +-1/sqrt(fan_in), the rest small."""
    g = torch.Generator().manual_seed(seed)
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if b is not None]
    for name, t in tensors:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        r = torch.rand(t.shape, generator=g, dtype=torch.float32) * 2 - 1
        if "norm" in name:
            v = 1 + 0.1 * r
        elif t.dim() >= 2:
            v = r / t.shape[-1] ** 0.5
        else:
            v = 0.1 * r
        t.data.copy_(v.to(t.dtype))


def build_model(vc, seed: int = 0):
    """The real KimiLinearForCausalLM under `vc`, random weights (vLLM's dummy initialiser), processed as
    vLLM's loader does after loading; the KDA layers' state caches bound."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype
    with set_current_vllm_config(vc), cuda_stubs(), set_default_torch_dtype(torch.bfloat16):
        model = KimiLinearForCausalLM(vllm_config=vc)
        init_weights(model, seed)
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    return model


def kda_layers(model):
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention
    return [m for m in model.modules() if isinstance(m, KimiK3DeltaAttention)]


def mla_layers(model):
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention
    return [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]


MLA_BLOCK, MLA_CONTEXT = 16, 7   # latent cache block size (vLLM's CPU MLA takes 16); tokens cached before the step


def new_state(model, batch: int, seed: int = 1):
    """Per KDA layer, (conv_state, recurrent_state) for `batch` sequences, and per MLA layer a latent cache of
    one block per sequence, random (a mid-sequence step): (KDA states, MLA caches)."""
    g = torch.Generator().manual_seed(seed)
    kda = []
    for layer in kda_layers(model):
        dtypes = layer.get_state_dtype()
        shapes = layer.get_state_shape()
        kda.append(tuple((0.1 * torch.randn((batch, *s), generator=g)).to(dt) for s, dt in zip(shapes[:2], dtypes[:2])))
    mla = [(0.5 * torch.randn((batch, MLA_BLOCK, m.head_size), generator=g)).to(torch.bfloat16)
           for m in mla_layers(model)]
    return kda, mla


def decode_context(model, vc, batch: int, state):
    """vLLM's forward context for one decode step of `batch` sequences, decodes only: KDA metadata (one state
    slot per sequence), MLA metadata (sequence i in cache block i, MLA_CONTEXT tokens cached, the new one
    written after them) and the layers' caches bound to `state` (mutated in place)."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata, MLACommonMetadata
    from vllm.models.kimi_k3.nvidia.kda_metadata import KimiK3KDAMetadata
    meta, slots = {}, {}
    kda, mla = state
    for layer, st in zip(kda_layers(model), kda):
        layer.kv_cache = list(st)
        meta[layer.prefix] = KimiK3KDAMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=batch, num_decode_tokens=batch, num_spec_decodes=0,
            num_spec_decode_tokens=0, num_actual_tokens=batch,
            non_spec_state_indices_tensor=torch.arange(batch, dtype=torch.int32))
    for layer, cache in zip(mla_layers(model), mla):
        layer.kv_cache = cache
        slots[layer.layer_name] = torch.arange(batch) * MLA_BLOCK + MLA_CONTEXT
        meta[layer.layer_name] = MLACommonMetadata(
            num_reqs=batch, max_query_len=1, max_seq_len=MLA_CONTEXT + 1, num_actual_tokens=batch,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32), slot_mapping=slots[layer.layer_name],
            num_decodes=batch, num_decode_tokens=batch, num_prefills=0,
            decode=MLACommonDecodeMetadata(block_table=torch.arange(batch, dtype=torch.int32)[:, None],
                                           seq_lens=torch.full((batch,), MLA_CONTEXT + 1, dtype=torch.int32),
                                           dcp_tot_seq_lens=None))
    return set_forward_context(meta, vc, num_tokens=batch, slot_mapping=slots)


def step(model, vc, ids, state):
    """One decode step: hidden states [M, hidden] (before the final norm, as vLLM's forward returns them)."""
    from vllm.config import set_current_vllm_config
    positions = torch.full_like(ids, 7)
    with set_current_vllm_config(vc), decode_context(model, vc, ids.shape[0], state):
        return model(ids, positions)


def compile_vllm_route(model, vc, k3_options: dict | None = None, compile_range=(1, 16)):
    """`model` compiled as vLLM's VllmBackend compiles a piece (as tests/_vllm_ranks.py does for the
    look-alike): vLLM's pre-grad IR functionalisation, AOTAutograd with Inductor's decompositions, then
    vLLM's PostGradPassManager (its own passes, then the K3 pass from
    `CompilationConfig.inductor_compile_config["post_grad_custom_post_pass"]`) in `pass_context(range)`;
    the rewritten graph runs op by op (the k3:: ops' CPU references). Returns the compiled callable and
    the pass."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config.utils import Range

    from vllm.compilation.passes.inductor_pass import CallableInductorPass

    from k3compile.integrations.vllm import make_pass
    from k3compile.passes.canonicalize import canonicalize
    # k3_options None: the unrewritten graph, only K3's canonicalisation of vLLM's forms (a K3 pass with
    # no pass enabled is not applicable to any range, so vLLM would not call it)
    k3 = make_pass(**k3_options) if k3_options is not None else None
    rng = Range(*compile_range)
    pm = PostGradPassManager()
    pc = vc.compilation_config.pass_config
    for flag in ("fuse_norm_quant", "fuse_act_quant"):   # quantisation fusions: none here, and their CUDA
        setattr(pc, flag, False)                           # pattern modules do not import on CPU
    pm.configure(vc)
    pm.add(k3 if k3 is not None else CallableInductorPass(canonicalize, uuid="k3-canonicalize"))
    pre = VllmIRInplaceFunctionalizationPass(vc)
    graphs = []

    def backend(gm, example_inputs):
        with pass_context(rng):
            pre(gm.graph)
            gm.recompile()

        def fw(g, _inputs):
            with pass_context(rng):
                pm(g.graph)
            g.recompile()
            graphs.append(g)
            return make_boxed_func(g.forward)
        return aot_autograd(fw_compiler=fw, decompositions=select_decomp_table())(gm, example_inputs)

    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, backend=backend), k3, graphs


# vLLM's latent-MoE tail tiers at TP > 1 (LatentMoERunner): "overlap" is tier 1, what CUDA runs at decode
# sizes (up to 256 tokens): the latent all-reduced and normalised, the full replicated W_up, the shared partial
# all-reduced on its own, then added; "column" is tier 2 (prefill sizes on CUDA; every size on vLLM's CPU
# platform, which turns the shared-experts stream off): W_up's rows of this rank added into the shared
# partial's columns, then one all-reduce
# "overlap_flashinfer": tier 1 where FlashInfer is installed (Hopper): the latent's all-reduce + RMSNorm is
# FlashInfer's fused op with a residual of zeros (tests/_vllm_ranks.py's CPU stand-in of that op)
TAIL_TIERS = {"overlap": "ALLREDUCE_OVERLAP", "column": "COLUMN_PARALLEL", "overlap_flashinfer": "ALLREDUCE_OVERLAP"}
_FI_SAVED: dict = {}


def tail_tier(name: str | None, model=None) -> None:
    """Make LatentMoERunner take tail tier `name` (TAIL_TIERS) whatever the token count (None: vLLM's choice),
    with FlashInfer's all-reduce + RMSNorm for the latent for "overlap_flashinfer" (the runner's zero
    residual buffers of `model` dropped, so that, as in a server's first, compiled call, the trace makes it)."""
    import vllm.model_executor.layers.fused_allreduce_gemma_rms_norm as far
    from vllm.models.kimi_k3.nvidia.latent_moe_runner import LatentMoERunner, LatentTailTier
    if not hasattr(LatentMoERunner, "_k3_select_tail_tier"):
        LatentMoERunner._k3_select_tail_tier = LatentMoERunner._select_tail_tier
    keys = ("flashinfer_trtllm_fused_allreduce_norm", "_AR_RESIDUAL_RMS_NORM", "_can_use_flashinfer")
    if not _FI_SAVED:
        _FI_SAVED.update({k: getattr(far, k) for k in keys})
    for k in keys:
        setattr(far, k, _FI_SAVED[k])
    if name is None:
        LatentMoERunner._select_tail_tier = LatentMoERunner._k3_select_tail_tier
        return
    tier = getattr(LatentTailTier, TAIL_TIERS[name])
    LatentMoERunner._select_tail_tier = lambda self, fused_output, shared_output: tier
    if name == "overlap_flashinfer":
        from _vllm_ranks import FI_OP, register_flashinfer_lookalike
        register_flashinfer_lookalike()
        far.flashinfer_trtllm_fused_allreduce_norm = getattr(torch.ops.vllm, FI_OP).default
        far._AR_RESIDUAL_RMS_NORM = 1   # flashinfer.comm.AllReduceFusionPattern.kARResidualRMSNorm
        far._can_use_flashinfer = lambda hidden_states, tp_size: (True, 64)
        for m in (model.modules() if model is not None else ()):
            runner = getattr(m, "runner", None) or getattr(m, "_runner", None)
            for obj in (m, runner):
                if obj is not None and "_zero_residual" in getattr(obj, "__dict__", {}):
                    del obj.__dict__["_zero_residual"]


def real_model_worker(rank: int, world: int, batch: int = 2, tiers: tuple = (None,)) -> dict:
    """In a fresh process (the shims patch vLLM's modules): vLLM's groups over the gloo world, the tiny
    real model, one decode step uncompiled (the reference), then compiled on vLLM's route twice: with
    the K3 pass (every pass) and with the K3 pass running none (canonicalisation only: the unrewritten
    graph, its vLLM forms in ATen). Returns the reports, the graphs' remaining Triton kernels, the
    rewritten graph's K3 ops and the outputs' differences; with several latent-MoE tail `tiers`
    (TAIL_TIERS, TP > 1), that for the first and, under "tiers", that for each."""
    os.environ.pop("TRITON_INTERPRET", None)   # tests/conftest.py sets it without a GPU: the kernel must stay a JITFunction
    cpu_triton_backend()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    vc = vllm_config(world)
    install_shims()
    from k3compile.integrations.vllm import opaque_kimi_k3_mla
    opaque_kimi_k3_mla()   # what the plugin does (vllm_backend_worker): the MLA core one op for Dynamo
    with set_current_vllm_config(vc):
        ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                        distributed_init_method="env://", backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
        # as tests/_vllm_ranks.py: the all-reduce traces as torch.ops.vllm.all_reduce(x, "tp:0"), its CUDA form
        ps.get_tp_group().use_custom_op_call = True
    model = build_model(vc)
    ids = torch.arange(batch) * 7 + 3
    with torch.inference_mode(), eager_attn_res():
        ref = step(model, vc, ids, new_state(model, batch))
    runs = {}
    for tier in tiers:
        tail_tier(tier, model)
        out: dict = {}
        results = {}
        for name, opts in (("k3", {}), ("none", None)):
            f, k3, graphs = compile_vllm_route(model, vc, opts)
            with torch.no_grad():
                results[name] = step(f, vc, ids, new_state(model, batch))
            rep = k3.last if k3 is not None else None
            nodes = [n for g in graphs for n in g.graph.nodes if n.op == "call_function"]
            out[name] = {"report": rep.to_dict() if rep is not None else None,
                         "text": rep.render() if rep is not None else None,
                         "triton": sum(1 for n in nodes if "triton_kernel" in str(n.target)),
                         "forms": sorted({str(n.target) for n in nodes if str(n.target).startswith(("vllm.", "_C."))}),
                         "ops": _ops(nodes)}
        tail_tier(None)
        scale = ref.float().abs().max().item()
        out["err_vs_eager"] = (results["k3"].float() - ref.float()).abs().max().item() / scale
        out["err_rewrite"] = ((results["k3"].float() - results["none"].float()).abs().max().item()
                              / results["none"].float().abs().max().item())
        runs[tier] = out
    return {**runs[tiers[0]], "tiers": runs}


def _ops(nodes) -> dict:
    """What the graph runs, for the tests: every op's count by name, the attention layer of each fused residual
    op, the shape of each k3::moe_latent_tail's W_up (this rank's rows) and of each
    k3::router_latent_sharded's two weights."""
    from collections import Counter
    from k3compile.patterns.structure import op_name
    count = Counter(op_name(n) or str(n.target) for n in nodes)
    val = lambda a: tuple(a.meta["val"].shape)  # noqa: E731
    fused = [n for n in nodes if op_name(n) in ("k3::oproj_allreduce_residual", "k3::residual_norm")]

    def moe_output(x):   # an output of vLLM's MoE op (through views)
        while op_name(x) in ("aten::view", "aten::alias", "aten::reshape"):
            x = x.args[0]
        return getattr(x, "target", None) is operator.getitem and op_name(x.args[0]) == "vllm::moe_forward_shared"

    def core(n, forward: bool):   # the nearest of vLLM's attention cores after (layer input) / before (o-proj) n
        from k3compile.patterns.roles import VLLM_ATTENTION_OPS
        seen, frontier = {n}, [n]
        while frontier:
            frontier = [y for x in frontier for y in (x.users if forward else x.all_input_nodes) if y not in seen]
            for y in frontier:
                if op_name(y) in VLLM_ATTENTION_OPS:
                    return op_name(y)
                seen.add(y)
        return None

    return {"count": dict(count),
            # per fused residual op: the attention core of its layer (an o-proj's before it, a layer input's after)
            "cores": [(op_name(n), core(n, op_name(n) == "k3::residual_norm")) for n in fused],
            # all-reduces of one of vLLM's MoE op's partials on its own (c10d's or k3::all_reduce_prefetch)
            "moe_partial_all_reduces": sum(1 for n in nodes if op_name(n) in (
                "_c10d_functional::all_reduce", "k3::all_reduce_prefetch") and moe_output(n.args[0])),
            # per fused residual op: (its AttnRes blocks, whether it normalises: the mixer / norm after it)
            "residual_ops": [(op_name(n), len(n.args[3] if op_name(n) == "k3::oproj_allreduce_residual" else n.args[2]),
                              (n.args[6] if op_name(n) == "k3::oproj_allreduce_residual" else n.args[5]) is not None)
                             for n in fused],
            "tail_w_up": [val(n.args[4]) for n in nodes if op_name(n) == "k3::moe_latent_tail"],
            "router_latent": [(val(n.args[1]), val(n.args[2]), n.args[4]) for n in nodes
                              if op_name(n) == "k3::router_latent_sharded"]}


def vllm_backend_worker(rank: int, world: int, batch: int = 2) -> dict:
    """The plugin route, as a vLLM server takes it: K3_VLLM=1, vLLM loads its general plugins (k3compile's
    turns the hook on, gives vLLM's Kimi K3 decoder vLLM's `support_torch_compile` and makes its MLA
    attention core one op for Dynamo), the model is built
    under `CompilationConfig(mode=VLLM_COMPILE)` and its first call compiles through vLLM's own VllmBackend
    (Inductor on CPU) with the K3 pass in vLLM's PostGradPassManager. Returns the pass's reports."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["K3_VLLM"] = "1"
    cpu_triton_backend()
    install_shims()
    from vllm.config import CompilationConfig, CompilationMode, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    vc = vllm_config(world, CompilationConfig(mode=CompilationMode.VLLM_COMPILE))
    pc = vc.compilation_config.pass_config
    for flag in ("fuse_norm_quant", "fuse_act_quant"):
        setattr(pc, flag, False)
    k3 = vc.compilation_config.inductor_compile_config.get("post_grad_custom_post_pass")
    with set_current_vllm_config(vc):
        ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                        distributed_init_method="env://", backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model = build_model(vc)
    ids = torch.arange(batch) * 7 + 3
    with torch.no_grad():
        h = step(model, vc, ids, new_state(model, batch))
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention
    return {"pass": repr(k3), "wrapped": isinstance(model.model, TorchCompileWithNoGuardsWrapper),
            "mla_opaque": getattr(MultiHeadLatentAttention._attention, "_k3_opaque", False),
            "compiled": bool(getattr(model.model, "compiled", False)), "calls": getattr(k3, "calls", 0),
            "report": k3.last.to_dict() if getattr(k3, "last", None) is not None else None,
            "text": k3.last.render() if getattr(k3, "last", None) is not None else None,
            "finite": bool(torch.isfinite(h.float()).all())}
