"""The K3 passes as a vLLM post-grad pass (vLLM 0.33's `InductorPass` contract).

    from vllm.config import CompilationConfig
    from k3compile.integrations.vllm import make_pass
    CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": make_pass(strict=True)})
    CompilationConfig(inductor_passes={"post_grad_custom_post_pass": "k3compile_vllm.k3_pass"})  # JSON / CLI

vLLM's `VllmBackend` (mode VLLM_COMPILE) adds the pass to its `PostGradPassManager`, which runs vLLM's
own fusions first, then this pass for each compile range it `is_applicable_for_range` to, then its
clean-up, vLLM IR lowering and de-functionalisation. The pass canonicalises vLLM's op forms
(`torch.ops.vllm.all_reduce`, `vllm_ir.rms_norm` / `fused_add_rms_norm`, `auto_functionalized` in-place
ops; `passes/canonicalize.py`) and leaves all-reduces vLLM already fused (FlashInfer / AITER) alone,
saying so in the report (`patterns/vllm_forms.py`).

Batch ranges: a pass applies to a compile range [start, end] (tokens) when its `m_ranges` entry
contains the whole range; `is_applicable_for_range` is true when any enabled pass's range meets
it, so a range that only overlaps gets a report that says which passes were skipped and why.
Align vLLM's `compile_ranges_endpoints` with the passes' range bounds to get both sides fused.

`vllm.general_plugins` entry point `k3compile` (`vllm_plugin.register`): with `K3_VLLM=1` every
`CompilationConfig` made in the process gets this pass (see `install_config_hook`), and vLLM's Kimi K3
decoder gets vLLM's own `support_torch_compile` (`compile_kimi_k3`; vLLM 0.33 ships it without one) and
its MLA attention core one op for Dynamo (`opaque_kimi_k3_mla`: Dynamo cannot trace vLLM's Python for it).
The other route, `CompilationConfig(mode="STOCK_TORCH_COMPILE", backend="k3")`, needs nothing from
here: vLLM then calls the `k3` torch.compile backend, which canonicalises the same op forms.
"""
from __future__ import annotations

import hashlib
import logging
import pathlib
import sys

from .vllm_version import (EXTRA, SUPPORTED_SERIES, TESTED_VERSION, UnsupportedVllmVersion, check_version,
                           require_vllm)

__all__ = ["K3VllmPass", "make_pass", "install_config_hook", "compile_kimi_k3", "opaque_kimi_k3_mla", "MLA_OP",
           "uninstall_config_hook", "VLLM_VERSION", "TESTED_VERSION", "SUPPORTED_SERIES", "EXTRA",
           "UnsupportedVllmVersion", "check_version"]

log = logging.getLogger("k3compile")

VLLM_VERSION = require_vllm()  # ImportError naming the extra, or UnsupportedVllmVersion

from vllm.compilation.passes.inductor_pass import InductorPass, get_pass_context  # noqa: E402

from ..options import K3Options  # noqa: E402
from ..passes.manager import PassManager  # noqa: E402


def _adapter_hash() -> str:
    return hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()


def _current_range() -> tuple[int, int] | None:
    """vLLM's compile range for the graph being compiled ([start, end] tokens), if inside vLLM's pass context."""
    try:
        r = get_pass_context().compile_range
    except AssertionError:  # called outside vLLM's pass context (e.g. Inductor run directly)
        return None
    return (int(r.start), int(r.end))


class K3VllmPass(InductorPass):
    """One vLLM post-grad pass running the K3 pass manager. Options as `k3compile.backend(**options)`."""

    def __init__(self, opts: K3Options | None = None, **options):
        self.opts = opts if opts is not None else K3Options.make(**options)
        self.last = None   # the last CompileReport
        self.calls = 0

    def uuid(self) -> str:
        """Source of the passes and this adapter, the options, the rank, torch and vLLM versions.

        Not the compile range: vLLM's PostGradPassManager adds that to its own uuid."""
        return InductorPass.hash_dict({"k3": PassManager(self.opts).uuid(), "adapter": _adapter_hash(),
                                       "vllm": VLLM_VERSION})

    def is_applicable_for_range(self, compile_range) -> bool:
        s, e = int(compile_range.start), int(compile_range.end)
        for p in self.opts.passes:
            lo, hi = self.opts.m_ranges.get(p, (1, 1 << 30))
            if lo <= e and s <= hi:
                return True
        return False

    def __call__(self, graph) -> None:
        rng = _current_range()
        self.calls += 1
        name = f"vllm graph {self.calls}" + (f", compile range [{rng[0]}, {rng[1]}]" if rng else "")
        mgr = PassManager(self.opts, name=name, compile_range=rng)
        mgr(graph)
        self.last = mgr.last
        _warn_if_split(mgr.last)

    def __repr__(self) -> str:
        return f"K3VllmPass(passes={list(self.opts.passes)}, strict={self.opts.strict})"


def _warn_if_split(report) -> None:
    """MoE layers but no attention core: vLLM's piecewise split took the attention ops out of this graph."""
    if report is None or report.structure.get("attention_layers") or not report.structure.get("moe_layers"):
        return
    mod = sys.modules.get("vllm.config.vllm")
    cfg = mod.get_current_vllm_config_or_none() if mod is not None else None
    cc = getattr(cfg, "compilation_config", None)
    if cc is not None and cc.splitting_ops and not cc.use_inductor_graph_partition:
        log.warning("k3: %s has MoE layers but no attention cores: vLLM splits the graph at %s, so "
                    "fuse_oproj_allreduce cannot see the o-projections; set "
                    "CompilationConfig(use_inductor_graph_partition=True) or splitting_ops=[]",
                    report.graph, cc.splitting_ops)


def make_pass(**options) -> K3VllmPass:
    """A configured pass: `make_pass(strict=True, skip=["overlap_shared_expert"], m_ranges={...})`."""
    return K3VllmPass(**options)


def install_config_hook() -> None:
    """From now on, every vLLM `CompilationConfig` made in this process gets the K3 pass in
    `inductor_compile_config["post_grad_custom_post_pass"]` (options from the K3_* environment
    variables), unless it already has a pass there or in `inductor_passes`, and `shape_padding`
    False unless set (pad_mm's padded GEMMs hide sites from the passes). Idempotent."""
    from vllm.config import CompilationConfig
    orig = CompilationConfig.__post_init__
    if getattr(orig, "_k3_hook", False):
        return
    key = "post_grad_custom_post_pass"

    def __post_init__(self, *args, **kwargs):
        have = self.inductor_compile_config.get(key, self.inductor_passes.get(key))
        if isinstance(have, K3VllmPass) or (isinstance(have, str) and have.startswith("k3compile_vllm.")):
            pass  # the K3 pass is configured explicitly
        elif have is not None:
            log.warning("k3: K3_VLLM is set but this CompilationConfig already has a %s; "
                        "left as configured (the K3 pass is not added)", key)
        else:
            self.inductor_compile_config[key] = make_pass()
            # as the k3 backend does: Inductor's timing-based pad_mm hides GEMM sites from the pass
            self.inductor_compile_config.setdefault("shape_padding", False)
        return orig(self, *args, **kwargs)

    __post_init__._k3_hook = True
    __post_init__._k3_orig = orig
    CompilationConfig.__post_init__ = __post_init__


KIMI_K3_DECODER = ("vllm.models.kimi_k3.nvidia.model", "KimiLinearModel")


def compile_kimi_k3() -> bool:
    """Apply vLLM's own `support_torch_compile` to vLLM 0.33's Kimi K3 decoder (`KimiLinearModel`), which
    has no decorator: without it VLLM_COMPILE compiles nothing of Kimi K3 and the K3 pass is never called.
    Dynamic dims are inferred by vLLM from `forward`'s annotations (dim 0 of input_ids / positions /
    inputs_embeds); vLLM's usual rules still apply (no compile under NONE / STOCK_TORCH_COMPILE). Its MLA
    layers' attention core becomes one op under Dynamo (`opaque_kimi_k3_mla`).
    Idempotent; True when the class is compiled by vLLM from now on. An import failure (e.g. a vLLM build
    without the model) is one warning line, and the model then runs uncompiled as before."""
    import importlib
    try:
        mod = importlib.import_module(KIMI_K3_DECODER[0])
        cls = getattr(mod, KIMI_K3_DECODER[1])
    except Exception as e:  # noqa: BLE001 - vLLM's model import can fail in many ways off its platform
        log.warning("k3: vLLM's Kimi K3 model not importable (%s: %s); it is left uncompiled",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return False
    from vllm.compilation.decorators import support_torch_compile
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    if TorchCompileWithNoGuardsWrapper not in cls.__bases__:
        support_torch_compile(cls)
    opaque_kimi_k3_mla()
    return True


KIMI_K3_MLA = ("vllm.models.kimi_k3.nvidia.mla", "MultiHeadLatentAttention")
MLA_OP = "k3vllm::kimi_k3_mla_attention"


def opaque_kimi_k3_mla() -> bool:
    """Make vLLM 0.33's Kimi K3 MLA attention core one custom op while Dynamo traces, as vLLM's own
    attention layers are (`vllm::unified_mla_attention_with_output`).

    `MultiHeadLatentAttention._attention` (vLLM's decode cache insert, its attention backend's latent
    attention, then W_UV written into `attn_out` through a transposed `out=`) is plain Python, written for
    breakable CUDA graphs, which run it eagerly; Dynamo refuses the transposed `out=` ("non-contiguous
    `out=` tensor"), so VLLM_COMPILE of a model with an MLA layer would fail. While Dynamo traces, the
    method calls `k3vllm::kimi_k3_mla_attention(positions, q, kv_c_normed, k_pe, attn_out!, layer_name)`,
    which finds the layer in vLLM's forward context (`no_compile_layers`, where the layer registers itself)
    and runs vLLM's method eagerly; uncompiled calls are vLLM's own. Not a splitting op: the graph stays
    whole, as for the KDA layers. Idempotent; False when the class does not import."""
    import importlib
    try:
        cls = getattr(importlib.import_module(KIMI_K3_MLA[0]), KIMI_K3_MLA[1])
    except Exception as e:  # noqa: BLE001 - as compile_kimi_k3
        log.warning("k3: vLLM's Kimi K3 MLA layer not importable (%s); it is left as vLLM wrote it", type(e).__name__)
        return False
    if getattr(cls._attention, "_k3_opaque", False):
        return True
    import torch
    eager = cls._attention

    @torch.library.custom_op(MLA_OP, mutates_args=("attn_out",), schema=(
        "(Tensor positions, Tensor q, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) attn_out, str layer_name) -> ()"))
    def kimi_k3_mla_attention(positions, q, kv_c_normed, k_pe, attn_out, layer_name):
        from vllm.forward_context import get_forward_context
        eager(get_forward_context().no_compile_layers[layer_name], positions, q, kv_c_normed, k_pe, attn_out)

    @kimi_k3_mla_attention.register_fake
    def _(positions, q, kv_c_normed, k_pe, attn_out, layer_name):
        return None

    def _attention(self, positions, q, kv_c_normed, k_pe, attn_out):
        if torch.compiler.is_compiling():
            return kimi_k3_mla_attention(positions, q, kv_c_normed, k_pe, attn_out, self.layer_name)
        return eager(self, positions, q, kv_c_normed, k_pe, attn_out)

    _attention._k3_opaque = True
    cls._attention = _attention
    return True


def uninstall_config_hook() -> None:
    from vllm.config import CompilationConfig
    orig = getattr(CompilationConfig.__post_init__, "_k3_orig", None)
    if orig is not None:
        CompilationConfig.__post_init__ = orig
