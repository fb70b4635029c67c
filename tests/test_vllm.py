"""The vLLM hook against the real vLLM 0.33.0 package (marker `vllm`; CI's second step, .ci/vllm-tests.sh).

Graphs hold vLLM's real op forms: the K3 model is written with vLLM's own ops (tests/_vllm_ranks.py:
`tensor_model_parallel_all_reduce` -> `torch.ops.vllm.all_reduce(x, "tp:0")` on vLLM's TP group,
`vllm.ir.ops.rms_norm`, `vllm.ir.ops.fused_add_rms_norm.maybe_inplace`) and compiled through vLLM's own
pre-grad IR functionalisation, `PostGradPassManager`, `pass_context(Range)` and `CompilationConfig`.
vLLM runs on its CPU platform (VLLM_TARGET_DEVICE=cpu, gloo). Not real here, because they need CUDA:
vLLM's `_C` ops (their schemas are defined so vLLM's FixFunctionalizationPass can name them) and the
FlashInfer all-reduce fusion (reproduced with vLLM's own patterns and an op with its schema).

Tolerances: bf16 runs use a vLLM IR provider that rounds like the fused K3 ops, so the rewritten graph
must equal the uncompiled model exactly (0); fp32 runs compare against vLLM's native implementation,
which normalises the unrounded fp32 sum: within 1e-5 relative (op by op) and 1e-4 (Inductor codegen).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.vllm

ALL = ("shard_router_latent", "fuse_router_topk", "fold_moe_finalize", "fuse_oproj_allreduce", "overlap_shared_expert")
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu"}


@pytest.fixture(autouse=True, scope="module")
def _vllm_cpu():
    """vLLM's CPU platform, here and in the processes these tests start (autouse: set up first)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in CPU_ENV.items():
            mp.setenv(k, v)
        yield


def _passes(rep):
    return {p["name"]: p for p in rep["passes"]}


# passes with nothing to do on this model, and the reason their report gives
NOT_APPLICABLE = {"lower_mxfp4_experts": "no plain-torch experts to lower"}   # its experts are an expert op


def _full_match(rep, tp):
    for name, p in _passes(rep).items():
        assert p["error"] is None, (name, p["error"])
        if name in NOT_APPLICABLE:
            assert p["skipped"] and NOT_APPLICABLE[name] in p["skipped"], (name, p["skipped"])
            continue
        assert p["skipped"] is None, (name, p["skipped"])
        if name == "pair_pdl" and p["expected"] == 0:
            # the norm ops' outputs reach the decode GEMMs of vLLM's route through other nodes than views
            # (not paired yet: a PDL gap on CUDA, not a numerics one), or TP > 1: the report says which
            assert any("not paired" in n or "TP=1 form" in n for n in p["notes"]), p["notes"]
            continue
        assert p["matched"] == p["expected"] > 0, (name, p["matched"], p["expected"], p["near_misses"][:3],
                                                   p["notes"])


# ----------------------------------------------------------------------------------------- the contract
def test_vllm_version_is_the_supported_one():
    import vllm

    from k3compile.integrations import vllm as hook
    assert vllm.__version__ == hook.VLLM_VERSION == hook.TESTED_VERSION


def test_both_config_routes_hold_the_pass_and_hash():
    from vllm.compilation.passes.inductor_pass import CallableInductorPass, InductorPass
    from vllm.config import CompilationConfig

    import k3compile_vllm
    from k3compile.integrations.vllm import K3VllmPass, make_pass
    ours = make_pass(strict=True)
    by_object = CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": ours})
    by_string = CompilationConfig(inductor_passes={"post_grad_custom_post_pass": "k3compile_vllm.k3_pass"})
    assert by_object.inductor_compile_config["post_grad_custom_post_pass"] is ours
    resolved = by_string.inductor_compile_config["post_grad_custom_post_pass"]
    assert resolved is k3compile_vllm.k3_pass  # not wrapped in CallableInductorPass: its uuid is ours
    for p in (ours, resolved):
        assert isinstance(p, InductorPass) and isinstance(p, K3VllmPass) and not isinstance(p, CallableInductorPass)
    # the config hash covers the pass through its uuid: other options, other hash
    other = CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": make_pass(strict=False)})
    assert by_object.compute_hash() != other.compute_hash()
    assert ours.uuid() != make_pass(strict=False).uuid()
    assert make_pass(strict=True).uuid() == ours.uuid()
    # vLLM deep-copies and pickles configs (to its workers): the pass survives both with its uuid
    import copy
    import pickle
    assert copy.deepcopy(ours).uuid() == pickle.loads(pickle.dumps(ours)).uuid() == ours.uuid()


_OTHER_PROCESS = """
import json
from vllm.config import CompilationConfig
from vllm.compilation.passes.inductor_pass import CallableInductorPass
from k3compile.integrations.vllm import make_pass
p = make_pass(skip=["overlap_shared_expert"], m_ranges={"fold_moe_finalize": (1, 64)})
a = CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": p})
b = CompilationConfig(inductor_passes={"post_grad_custom_post_pass": "k3compile_vllm.k3_pass"})
out = dict(uuid=p.uuid(), hash_object=a.compute_hash(), hash_string=b.compute_hash())
from vllm.plugins import load_general_plugins
load_general_plugins()  # K3_VLLM=1: every CompilationConfig made from now on carries the K3 pass
c = CompilationConfig()
mine = CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": CallableInductorPass(lambda g: None, uuid="mine")})
out.update(plugin=repr(c.inductor_compile_config.get("post_grad_custom_post_pass")), plugin_hash=c.compute_hash(),
           padding=c.inductor_compile_config.get("shape_padding"),
           padding_mine=mine.inductor_compile_config.get("shape_padding", "unset"),
           mine=repr(mine.inductor_compile_config["post_grad_custom_post_pass"]))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def other_process():
    """One more Python process (vLLM's import costs ~10 s), with K3_VLLM=1."""
    r = subprocess.run([sys.executable, "-c", _OTHER_PROCESS], capture_output=True, text=True,
                       env={**os.environ, **CPU_ENV, "K3_VLLM": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    return dict(json.loads(r.stdout.splitlines()[-1]), stderr=r.stderr)


def test_uuid_and_config_hashes_stable_across_processes(other_process):
    from vllm.config import CompilationConfig

    from k3compile.integrations.vllm import make_pass
    p = make_pass(skip=["overlap_shared_expert"], m_ranges={"fold_moe_finalize": (1, 64)})
    assert other_process["uuid"] == p.uuid()
    a = CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": p})
    b = CompilationConfig(inductor_passes={"post_grad_custom_post_pass": "k3compile_vllm.k3_pass"})
    assert other_process["hash_object"] == a.compute_hash()
    assert other_process["hash_string"] == b.compute_hash()
    assert p.uuid() != make_pass(skip=["overlap_shared_expert"]).uuid()  # the ranges are part of it


def test_plugin_turns_the_hook_on_from_the_environment(other_process, monkeypatch):
    from k3compile.options import PASS_ORDER
    assert other_process["plugin"] == f"K3VllmPass(passes={list(PASS_ORDER)}, strict=False)"
    from k3compile.passes.manager import PASSES
    assert sorted(PASS_ORDER) == sorted(PASSES)          # every registered pass, in the manager's order
    assert other_process["padding"] is False           # pad_mm off where the hook adds the pass
    # a pass the user configured is kept, and the log says so (and its config is left alone)
    assert "CallableInductorPass" in other_process["mine"] and other_process["padding_mine"] == "unset"
    assert "left as configured" in other_process["stderr"]
    # here K3_VLLM is unset: loading the plugins leaves CompilationConfig alone
    monkeypatch.delenv("K3_VLLM", raising=False)
    from vllm.config import CompilationConfig
    from vllm.plugins import load_general_plugins

    from k3compile.integrations.vllm_plugin import register
    load_general_plugins()
    register()
    c = CompilationConfig()
    assert "post_grad_custom_post_pass" not in c.inductor_compile_config
    assert c.compute_hash() != other_process["plugin_hash"]


@pytest.mark.parametrize("ranges,enabled,compile_range,applicable", [
    ({}, ALL, (1, 8192), True),                                             # default: every M
    ({p: (1, 256) for p in ALL}, ALL, (257, 8192), False),                  # wholly above every range
    ({p: (1, 256) for p in ALL}, ALL, (200, 300), True),                    # overlaps: the report says why
    ({p: (1, 256) for p in ALL}, ALL, (256, 256), True),                    # bounds are inclusive
    ({"fuse_oproj_allreduce": (1, 64), "fold_moe_finalize": (512, 4096)},
     ("fuse_oproj_allreduce",), (512, 512), False),                         # only a disabled pass covers it
    ({"fuse_oproj_allreduce": (1, 64), "fold_moe_finalize": (512, 4096)},
     ("fold_moe_finalize",), (512, 512), True),
    ({p: (16, 256) for p in ALL}, ALL, (1, 15), False),                     # wholly below
])
def test_is_applicable_for_range(ranges, enabled, compile_range, applicable):
    from vllm.config.utils import Range

    from k3compile.integrations.vllm import make_pass
    p = make_pass(passes=enabled, m_ranges=ranges)
    assert p.is_applicable_for_range(Range(*compile_range)) is applicable


# ----------------------------------------------------------------------------------------- VLLM_COMPILE route
@pytest.fixture(scope="module")
def tp1():
    """All TP=1 compiles in one fresh process (the vLLM-op model rebinds module globals)."""
    import concurrent.futures
    import multiprocessing

    from _vllm_ranks import tp1_worker
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(tp1_worker, 0, 1).result(timeout=900)


def test_vllm_compile_route_tp1_matches(tp1):
    """TP=1, 4 layers: full match in bf16 (exact, M=1 and a dynamic-M graph) and fp32 (vs vLLM's native norms)."""
    bf16, f32 = tp1["bf16"], tp1["f32"]
    assert bf16["err"] == {1: 0.0, 3: 0.0}
    assert len(bf16["reports"]) == 2  # M=1, then one dynamic-M graph
    for rep in bf16["reports"] + f32["reports"]:
        assert rep["graph"].endswith("compile range [1, 16]")
        _full_match(rep, tp=1)
    assert f32["err"][2] <= 1e-5


def test_vllm_compile_route_gates_passes_by_compile_range(tp1):
    """Passes whose batch range does not contain the compile range are skipped, with the reason."""
    gated = tp1["gated"]
    assert gated["err"] == {3: 0.0}
    p = _passes(gated["reports"][0])
    assert p["fuse_oproj_allreduce"]["matched"] == 4 and p["fuse_oproj_allreduce"]["skipped"] is None
    assert p["fold_moe_finalize"]["skipped"] == "compile range [1, 16] is not inside this pass's batch range [1, 8]"
    assert p["overlap_shared_expert"]["skipped"] == "compile range [1, 16] is not inside this pass's batch range [2, 64]"


def test_vllm_compile_route_inductor_codegen(tp1):
    """The real thing on CPU: vLLM's PostGradPassManager (with the K3 pass) as Inductor's post-grad pass."""
    r = tp1["inductor"]
    assert r["err"][2] <= 1e-4
    (rep,) = r["reports"]
    _full_match(rep, tp=1)
    assert rep["structure"]["attention_layers"] == 2


def test_vllm_compile_route_tp2_and_flashinfer_fused_sites():
    """TP=2 on gloo with vLLM's real all-reduce op and group names; then with vLLM's FlashInfer
    all-reduce fusion applied first: the o-proj and layer-input sites are left as vLLM fused them and
    reported; the latent's all-reduce + RMSNorm (no residual) is taken into the latent tail op."""
    from _vllm_ranks import vllm_compile_vs_eager

    from k3compile.distributed import run_ranks
    fp32 = {"dtypes": ("float32",)}
    runs = [dict(dtype="bfloat16", batches=(2,)),
            dict(dtype="float32", batches=(2,), options=fp32, rounding="native"),
            dict(dtype="float32", batches=(2,), options=fp32, rounding="native", fuse_allreduce=True)]
    for bf16, f32, fused in run_ranks(vllm_compile_vs_eager, 2, runs):
        assert bf16["err"] == {2: 0.0}
        _full_match(bf16["reports"][0], tp=2)
        assert f32["err"][2] <= 1e-5
        _full_match(f32["reports"][0], tp=2)
        assert fused["err"][2] <= 1e-5
        # vLLM fused 9 all-reduces of the 4-layer model: the o-proj ones of layers 0-2 (layer 3 writes an
        # AttnRes block first, so its post-attention norm is the mixer), the latent ones of the 3 MoE
        # layers, and the MLP outputs of layers 0-2 into the next layer's add + norm
        assert fused["fused_by_vllm"] == 9
        p = _passes(fused["reports"][0])
        assert p["fuse_oproj_allreduce"]["expected"] == p["fuse_oproj_allreduce"]["matched"] == 1
        assert not p["fuse_oproj_allreduce"]["near_misses"], p["fuse_oproj_allreduce"]["near_misses"]
        (note,) = p["fuse_oproj_allreduce"]["notes"]
        assert note.startswith("3 site(s) already fused by vLLM (flashinfer_trtllm_fused_allreduce_norm"), note
        # the latent's FlashInfer all-reduce + RMSNorm (a residual of zeros) is the tail's own all-reduce + norm:
        # k3::moe_latent_tail takes it with the up-projection and the add
        fmf = p["fold_moe_finalize"]
        assert fmf["expected"] == fmf["matched"] == 3 and not fmf["near_misses"] and not fmf["notes"], fmf
        assert p["shard_router_latent"]["matched"] == p["overlap_shared_expert"]["matched"] == 3
        assert p["fuse_router_topk"]["matched"] == p["fuse_router_topk"]["expected"] == 3
        # the layer inputs of layers 1-3 are those MLP-output fusions; the final norm's is K3's to fuse
        frn = p["fuse_residual_norm"]
        assert frn["expected"] == frn["matched"] == 1 and not frn["near_misses"], frn
        assert frn["notes"][0].startswith("3 site(s) already fused by vLLM (all-reduce + residual add + RMSNorm"), frn
        assert "6 all-reduce(s) already fused by vLLM (FlashInfer/AITER) get no L2 prefetch" in p["overlap_shared_expert"]["notes"]


# ----------------------------------------------------------------------------------------- STOCK_TORCH_COMPILE route
def test_stock_torch_compile_route_with_backend_k3(tp1):
    """CompilationConfig(mode=STOCK_TORCH_COMPILE, backend="k3"): vLLM hands the model to the k3 backend,
    whose graph holds vLLM's op forms (no vLLM pre-grad pass here: maybe_inplace stays, functionalised
    by torch as auto_functionalized_v2); K3_MODE=eager runs the rewritten graph op by op."""
    r = tp1["stock"]
    assert r["backend"] == "k3"
    assert r["err"] == {1: 0.0, 3: 0.0}
    assert r["forms"]["auto_functionalized_v2(vllm_ir.fused_add_rms_norm.maybe_inplace)"] > 0
    assert r["forms"]["vllm_ir.rms_norm.default"] > 0
    assert len(r["reports"]) == 2
    for rep in r["reports"]:
        _full_match(rep, tp=1)
