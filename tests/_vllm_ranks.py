"""The K3 model written with vLLM 0.33's real ops, compiled the two ways vLLM compiles (for tests/test_vllm.py).

`apply_vllm_ops()` rebinds the model's building blocks (the model module itself is unchanged) to
what a vLLM model calls: `vllm.distributed.tensor_model_parallel_all_reduce` (-> the real
`torch.ops.vllm.all_reduce(x, "tp:0")` on vLLM's TP group), `vllm.ir.ops.rms_norm` and, for the
AttnRes residual add + norm, `vllm.ir.ops.fused_add_rms_norm.maybe_inplace` (what vLLM's
`RMSNorm.forward_native(x, residual)` calls). Run with VLLM_TARGET_DEVICE=cpu (vLLM's CPU platform,
gloo) so vLLM's config and process groups can be built without a GPU.
"""
from __future__ import annotations

import contextlib

import torch

from k3compile.model.functional import rms_norm as K3_RMS_NORM  # before apply_vllm_ops rebinds the module's name

FI_OP = "flashinfer_trtllm_fused_allreduce_norm"


def apply_vllm_ops() -> None:
    import vllm.ir.ops as ir
    from vllm.distributed import tensor_model_parallel_all_reduce

    from k3compile.model import functional, layers

    def all_reduce(x, tp):
        return x if tp.size == 1 else tensor_model_parallel_all_reduce(x)

    def rms_norm(x, weight, eps):
        return ir.rms_norm(x, weight, eps, None)

    def mix(prefix, delta, blocks, w_norm, w_qk, g_out, eps):
        if delta is not None and not blocks:
            return ir.fused_add_rms_norm.maybe_inplace(delta, prefix, g_out, eps, None)
        return functional.attnres_mix(prefix, delta, blocks, w_norm, w_qk, g_out, eps)

    layers.all_reduce = all_reduce
    layers.rms_norm = rms_norm
    functional.__dict__["rms_norm"] = rms_norm
    layers.attnres_mix = mix


def init_vllm_tp(rank: int, world: int) -> None:
    """vLLM's process groups over the already initialised torch.distributed world (gloo)."""
    from vllm.distributed import parallel_state as ps
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                    distributed_init_method="env://", backend="gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    # On CUDA (use_custom_op_collectives) vLLM's all-reduce traces as torch.ops.vllm.all_reduce(x, "tp:0");
    # the CPU platform calls its communicator directly. Take the CUDA path: the same real op, run on gloo.
    ps.get_tp_group().use_custom_op_call = True


# vLLM 0.33's `_C` schemas that its FixFunctionalizationPass names (read from the wheel's _C_stable_libtorch.abi3.so)
_C_SCHEMAS = [
    "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()",
    "rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()",
    "silu_and_mul(Tensor! result, Tensor input) -> ()",
    "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, "
    "bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()",
    "fused_qk_norm_rope(Tensor! qkv, int num_heads_q, int num_heads_k, int num_heads_v, int head_dim, float eps, "
    "Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, bool is_neox, Tensor position_ids, "
    "int forced_token_heads_per_warp=-1) -> ()",
    "silu_and_mul_quant(Tensor! result, Tensor input, Tensor scale) -> ()",
    "rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor weight, Tensor scale, float epsilon) -> ()",
    "fused_add_rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor! residual, Tensor weight, "
    "Tensor scale, float epsilon) -> ()",
    "rms_norm_dynamic_per_token_quant(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, "
    "Tensor? scale_ub, Tensor!? residual) -> ()",
    "silu_and_mul_nvfp4_quant(Tensor! result, Tensor! result_block_scale, Tensor input, Tensor input_global_scale) -> ()",
]
_C_LIB = None


def register_c_stubs() -> None:
    """vLLM's FixFunctionalizationPass names `torch.ops._C.*` ops that only vLLM's compiled `_C` library
    defines; the CUDA wheel's `_C` does not load on a CPU machine, so define them (schemas only: the
    K3 graph never calls them)."""
    global _C_LIB
    _C_LIB = _C_LIB or torch.library.Library("_C", "FRAGMENT")
    for schema in _C_SCHEMAS:
        if not hasattr(torch.ops._C, schema.split("(")[0]):
            _C_LIB.define(schema)


# ------------------------------------------------------------------ vLLM's FlashInfer all-reduce fusion, reproduced
def _fi_allreduce_norm(allreduce_in: torch.Tensor, residual: torch.Tensor, rms_gamma: torch.Tensor, rms_eps: float,
                       world_size: int, launch_with_pdl: bool, fp32_acc: bool, max_token_num: int, pattern_code: int,
                       norm_out: torch.Tensor | None = None, quant_out: torch.Tensor | None = None,
                       scale_out: torch.Tensor | None = None, scale_factor: torch.Tensor | None = None,
                       weight_bias: float = 0.0) -> None:
    """CPU stand-in with the signature of vLLM 0.33's `call_trtllm_fused_allreduce_norm` (so the same
    schema): all-reduce + residual add + RMSNorm, written in place as FlashInfer does."""
    from vllm.distributed import tensor_model_parallel_all_reduce
    s = tensor_model_parallel_all_reduce(allreduce_in.clone()) + residual
    normed = K3_RMS_NORM(s, rms_gamma, rms_eps)
    if norm_out is None:  # fused add + norm: allreduce_in <- normed, residual <- the sum
        allreduce_in.copy_(normed)
        residual.copy_(s)
    else:                 # norm only: norm_out <- normed, allreduce_in <- the all-reduced sum
        norm_out.copy_(normed)
        allreduce_in.copy_(s)


def register_flashinfer_lookalike() -> None:
    """`torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm`, registered the way vLLM registers it
    (`direct_register_custom_op`, same mutated arguments); vLLM only does so when flashinfer is installed."""
    from vllm.utils.torch_utils import direct_register_custom_op
    if hasattr(torch.ops.vllm, FI_OP):
        return
    direct_register_custom_op(op_name=FI_OP, op_func=_fi_allreduce_norm,
                              mutates_args=["allreduce_in", "residual", "norm_out", "quant_out", "scale_out"],
                              dispatch_key="CPU")


def flashinfer_fusion_pass(epsilon: float, dtype: torch.dtype, world_size: int):
    """vLLM 0.33's AllReduceFusionPass patterns without quantisation (AllReduceRMSNormPattern,
    AllReduceFusedAddRMSNormPattern and its first-return-only variant), copied from
    vllm/compilation/passes/fusion/allreduce_rms_fusion.py with the op above, as an InductorPass."""
    import torch._inductor.pattern_matcher as pm
    from torch._higher_order_ops.auto_functionalize import auto_functionalized
    import vllm.ir.ops
    from vllm.compilation.passes.inductor_pass import InductorPass, enable_fake_mode
    from vllm.distributed import tensor_model_parallel_all_reduce

    register_flashinfer_lookalike()
    op = getattr(torch.ops.vllm, FI_OP).default
    kw = dict(world_size=world_size, launch_with_pdl=True, fp32_acc=True, max_token_num=1024)
    K_AR_RESIDUAL_RMSNORM = 1  # flashinfer.comm.AllReduceFusionPattern.kARResidualRMSNorm

    class FusionPass(InductorPass):
        def __init__(self):
            self.patterns = pm.PatternMatcherPass(pass_name="all_reduce_fusion_pass")
            self.matched = 0
            self.register()

        @enable_fake_mode
        def register(self):
            def empty(*s):
                return torch.empty(*s, dtype=dtype)

            def p_norm(input, weight):
                ar = tensor_model_parallel_all_reduce(input)
                return vllm.ir.ops.rms_norm(ar, weight, epsilon), ar

            def r_norm(input, weight):
                residual = torch.zeros_like(input)
                rms_result = torch.empty_like(input)
                a = auto_functionalized(op, allreduce_in=input, residual=residual, norm_out=rms_result,
                                        quant_out=None, scale_out=None, rms_gamma=weight, rms_eps=epsilon,
                                        pattern_code=K_AR_RESIDUAL_RMSNORM, **kw)
                return a[3], a[1]

            pm.register_replacement(p_norm, r_norm, [empty(5, 16), empty(16)], pm.fwd_only, self.patterns)

            def p_add(residual, input, weight):
                ar = tensor_model_parallel_all_reduce(input)
                return vllm.ir.ops.fused_add_rms_norm(ar, residual, weight, epsilon)

            def r_add(residual, input, weight):
                a = auto_functionalized(op, allreduce_in=input, residual=residual, norm_out=None, quant_out=None,
                                        scale_out=None, rms_gamma=weight, rms_eps=epsilon,
                                        pattern_code=K_AR_RESIDUAL_RMSNORM, **kw)
                return a[1], a[2]

            inputs = [empty(5, 16), empty(5, 16), empty(16)]
            pm.register_replacement(p_add, r_add, inputs, pm.fwd_only, self.patterns)
            first = lambda fn: lambda a, b, c: fn(a, b, c)[0]  # noqa: E731
            pm.register_replacement(first(p_add), first(r_add), inputs, pm.fwd_only, self.patterns)

        def __call__(self, graph):
            self.matched += self.patterns.apply(graph)

    return FusionPass()


# ------------------------------------------------------------------ rounding of the eager reference
def _k3_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                 variance_size: int | None = None) -> torch.Tensor:
    assert variance_size is None
    return K3_RMS_NORM(x, weight, epsilon)


def _k3_fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                           variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    updated = x_residual + x  # the sum in the model dtype, as vLLM's CUDA kernel rounds it
    return _k3_rms_norm(updated, weight, epsilon), updated


@contextlib.contextmanager
def k3_rounding():
    """Run vLLM IR's rms_norm / fused_add_rms_norm with a provider ("k3_rounding", registered through
    vLLM IR's provider API) that rounds like the fused K3 ops, so a rewritten bf16 graph can be compared
    bit-exactly with the uncompiled model. Without it vLLM uses its native implementation (the
    fp32 runs compare against that)."""
    import vllm.ir.ops as ir
    if "k3_rounding" not in ir.rms_norm.impls:
        ir.rms_norm.register_impl("k3_rounding")(_k3_rms_norm)
        ir.fused_add_rms_norm.register_impl("k3_rounding")(_k3_fused_add_rms_norm)
    with ir.rms_norm.set_priority(["k3_rounding"]), ir.fused_add_rms_norm.set_priority(["k3_rounding"]):
        yield


# ------------------------------------------------------------------ the VLLM_COMPILE route, as VllmBackend runs it
def vllm_compile_vs_eager(rank, world, runs):
    """For each run (a dict of `compile_run`'s keyword arguments), `compile_run`; vLLM's groups are set up once."""
    from vllm.config import VllmConfig, set_current_vllm_config
    register_c_stubs()
    apply_vllm_ops()
    if world > 1:
        with set_current_vllm_config(VllmConfig()):
            init_vllm_tp(rank, world)
    return [compile_run(**r) for r in runs]


def compile_run(dtype="bfloat16", batches=(2,), options=None, fuse_allreduce=False, inductor=False,
                num_layers=4, compile_range=(1, 16), rounding="k3"):
    """Compile the vLLM-op K3 model the way vLLM's VllmBackend does for one compile range:
    vLLM's pre-grad IR functionalisation, then AOTAutograd (auto_functionalized v1, vLLM's inductor
    config), then vLLM's PostGradPassManager with the K3 pass added through
    `CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": ...})` (after vLLM's own
    fusions, plus the FlashInfer all-reduce fusion above when `fuse_allreduce`), inside vLLM's
    `pass_context(compile_range)`. `inductor=True` hands that pass manager to Inductor (real codegen);
    otherwise the rewritten graph runs op by op. `rounding="k3"`: vLLM IR's norms round like the
    fused ops (`k3_rounding`), so bf16 results compare exactly; "native": vLLM's native implementation.
    Returns per batch size the max relative error against the uncompiled model, the K3 reports, and
    how many sites the FlashInfer fusion took."""
    import k3compile
    from k3compile.integrations.vllm import make_pass
    from k3compile.model import K3Config, K3Model, TPInfo
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.utils import Range

    vc = VllmConfig(compilation_config=CompilationConfig(
        inductor_compile_config={"post_grad_custom_post_pass": make_pass(**(options or {}))}))
    icc = vc.compilation_config.inductor_compile_config
    rng = Range(*compile_range)
    out = {"err": {}, "reports": [], "fused_by_vllm": 0}
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    with set_current_vllm_config(vc), (k3_rounding() if rounding == "k3" else contextlib.nullcontext()):
        cfg = K3Config.tiny(dtype=dtype, num_layers=num_layers)
        model = K3Model(cfg, TPInfo.current())
        pm = PostGradPassManager()
        pm.configure(vc)
        fi = flashinfer_fusion_pass(cfg.rms_eps, cfg.torch_dtype, world) if fuse_allreduce else None
        if fi is not None:
            pm.add(fi)  # vLLM's fusions run before the custom post pass
        pm.add(icc["post_grad_custom_post_pass"])  # what VllmBackend.configure_post_pass does
        pre = VllmIRInplaceFunctionalizationPass(vc)
        patches = {k: v for k, v in icc.items() if k != "post_grad_custom_post_pass"}
        patches["post_grad_custom_post_pass"] = pm

        def backend(gm, example_inputs):
            with pass_context(rng):
                pre(gm.graph)
                gm.recompile()
                if inductor:
                    from torch._inductor.compile_fx import compile_fx
                    return compile_fx(gm, example_inputs, config_patches=patches)
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd
            from torch._inductor.decomposition import select_decomp_table

            def fw(g, _inputs):
                with pass_context(rng):
                    pm(g.graph)
                g.recompile()
                return make_boxed_func(g.forward)
            with torch._inductor.config.patch(**{k: v for k, v in patches.items()
                                                 if k == "enable_auto_functionalized_v2"}):
                return aot_autograd(fw_compiler=fw, decompositions=select_decomp_table())(gm, example_inputs)

        k3compile.clear_reports()
        torch._dynamo.reset()
        f = torch.compile(model, fullgraph=True, backend=backend)
        with torch._inductor.config.patch(force_disable_caches=True):
            for M in batches:
                ids = torch.randint(0, cfg.vocab, (M, 1), generator=torch.Generator().manual_seed(M))
                ref = model(ids, model.new_cache(M))
                got = f(ids, model.new_cache(M))
                out["err"][M] = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        out["reports"] = [r.to_dict() for r in k3compile.reports()]
        out["fused_by_vllm"] = fi.matched if fi is not None else 0
    return out


# ------------------------------------------------------------------ the STOCK_TORCH_COMPILE route
def _record_forms(seen: dict):
    """Wrap the pass manager's canonicalisation to count the vLLM op forms each graph reaches it with."""
    from k3compile.passes import manager
    from k3compile.patterns.structure import op_name
    orig = manager.canonicalize

    def recording(graph):
        for n in graph.nodes:
            name = op_name(n)
            if n.op == "call_function" and name and name.split("::")[0] in ("vllm", "vllm_ir", "_C"):
                t = n.target
                form = f"{t.__name__}({n.args[0]})" if t in (torch.ops.higher_order.auto_functionalized,
                                                           torch.ops.higher_order.auto_functionalized_v2) else str(t)
                seen[form] = seen.get(form, 0) + 1
        return orig(graph)
    manager.canonicalize = recording


def stock_compile_vs_eager(rank, world, k3_mode="eager", batches=(2,), num_layers=4):
    """vLLM's STOCK_TORCH_COMPILE route as its model runner takes it: the backend is
    `CompilationConfig(mode="STOCK_TORCH_COMPILE", backend="k3").init_backend(vllm_config)` and the model
    is compiled with `model.compile(fullgraph=True, backend=backend)` (no options; K3_MODE picks the
    k3 backend's mode). Returns the errors against an uncompiled copy (vLLM IR norms rounding like the
    fused ops), the K3 reports, and the vLLM op forms the graphs held."""
    import os

    import k3compile
    from k3compile.model import K3Config, K3Model, TPInfo
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    os.environ["K3_MODE"] = k3_mode
    apply_vllm_ops()
    seen: dict = {}
    _record_forms(seen)
    cc = CompilationConfig(mode="STOCK_TORCH_COMPILE", backend="k3")
    vc = VllmConfig(compilation_config=cc)
    out = {"err": {}}
    with set_current_vllm_config(vc), k3_rounding():
        if world > 1:
            init_vllm_tp(rank, world)
        backend = vc.compilation_config.init_backend(vc)
        out["backend"] = backend
        cfg = K3Config.tiny(dtype="bfloat16", num_layers=num_layers)
        ref_model, model = K3Model(cfg, TPInfo.current()), K3Model(cfg, TPInfo.current())
        model.compile(fullgraph=True, backend=backend)  # what vLLM's GPU model runner does in this mode
        k3compile.clear_reports()
        with torch._inductor.config.patch(force_disable_caches=True):
            for M in batches:
                ids = torch.randint(0, cfg.vocab, (M, 1), generator=torch.Generator().manual_seed(M))
                ref = ref_model(ids, ref_model.new_cache(M))
                got = model(ids, model.new_cache(M))
                out["err"][M] = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    out["reports"] = [r.to_dict() for r in k3compile.reports()]
    out["forms"] = seen
    return out


def tp1_worker(rank, world):
    """Every TP=1 check of tests/test_vllm.py in one process (vLLM's import costs ~10 s per process)."""
    fp32 = {"dtypes": ("float32",)}
    # M=3 is inside every range below, so only the compile range [1, 16] decides
    ranges = {"fuse_oproj_allreduce": (1, 16), "fold_moe_finalize": (1, 8), "overlap_shared_expert": (2, 64)}
    bf16, f32, gated, inductor = vllm_compile_vs_eager(rank, world, [
        dict(dtype="bfloat16", batches=(1, 3)),
        dict(dtype="float32", batches=(2,), options=fp32, rounding="native"),
        dict(dtype="bfloat16", batches=(3,), options={"m_ranges": ranges}, compile_range=(1, 16)),
        # Inductor codegen on CPU takes most of this file's time: 2 layers (KDA; the eager runs cover MLA)
        dict(dtype="float32", batches=(2,), options=fp32, rounding="native", inductor=True, num_layers=2),
    ])
    stock = stock_compile_vs_eager(rank, world, "eager", (1, 3))
    return dict(bf16=bf16, f32=f32, gated=gated, inductor=inductor, stock=stock)
