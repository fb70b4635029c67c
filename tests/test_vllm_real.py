"""vLLM 0.33's own Kimi K3 model (`vllm.models.kimi_k3.nvidia.model.KimiLinearForCausalLM`) through vLLM's
compile route with the K3 pass (marker `vllm`; CI's second step, .ci/vllm-tests.sh).

The model is vLLM's, built from a tiny config (hidden 256; layers 0-1 KDA, layer 2 MLA; layer 0 dense,
layers 1-2 LatentMoE with a shared expert and the latent norm; AttnRes with one block), random weights, run
on vLLM's CPU platform. The shims that let it run without a GPU are listed, each with its reason, in
tests/_vllm_real.py's docstring: a placeholder Triton backend (so Dynamo captures vLLM's AttnRes Triton
kernel as on CUDA), CUDA streams stubbed, `_C::fused_kda_decode` and the MLA layer's two `_C` ops (its
decode cache insert, vLLM's CPU MLA decode) defined with their schemas and CPU implementations, the MLA
front-end's q/kv RMSNorm in PyTorch on CPU, reference experts for the MoE oracle, and the MoE runner
calling its opaque op as on CUDA, and at TP=2 each of vLLM's two latent-MoE tails in turn. The MLA
attention core is one op, `k3vllm::kimi_k3_mla_attention`, as K3's vLLM hook makes it (Dynamo cannot
trace vLLM's Python for it; integrations/vllm.py `opaque_kimi_k3_mla`).

Per pass, the sites matched equal the sites expected from role discovery (patterns/roles.py): the o-proj
+ AttnRes residual + mixer of layer 1 (KDA) and layer 2 (MLA), the layer inputs of layers 1-2, and per MoE
layer (vLLM's vllm::moe_forward_shared) the router + latent GEMMs and the latent tail; what runs inside
vLLM's MoE op (the router's selection, the routed and the shared experts) and the output mixer without a
norm are named near-misses, not counted as expected.

The compile route is the one tests/test_vllm.py takes for the look-alike model: vLLM's pre-grad
functionalisation, AOTAutograd, vLLM's PostGradPassManager with the K3 pass, the graph run op by op.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tp1():
    from _vllm_real import real_model_worker
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_TARGET_DEVICE", "cpu")
        mp.setenv("VLLM_KIMI_K3_GEMM_AR", "0")
        return _one(real_model_worker)


@pytest.fixture(scope="module")
def tp2():
    """Both ranks of TP=2 on gloo (vLLM's all-reduce as torch.ops.vllm.all_reduce on its TP group), with each
    of vLLM's two latent-MoE tails (tests/_vllm_real.py TAIL_TIERS): "overlap" (what CUDA runs at decode sizes:
    the full replicated W_up, the shared partial all-reduced on its own) first, then "column", then "overlap"
    with the latent's all-reduce + RMSNorm as FlashInfer's fused op (where FlashInfer is installed)."""
    from _vllm_real import real_model_worker

    from k3compile.distributed import run_ranks
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_TARGET_DEVICE", "cpu")
        mp.setenv("VLLM_KIMI_K3_GEMM_AR", "0")
        return run_ranks(real_model_worker, 2, 2, ("overlap", "column", "overlap_flashinfer"), fresh=True)


def _one(fn):
    """`fn(0, 1)` in one fresh process (the shims patch vLLM's modules), a gloo world of one."""
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(_tp1_entry, fn).result(timeout=900)


def _tp1_entry(fn):
    import os

    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    return fn(0, 1)


def test_real_model_reaches_the_k3_pass_and_its_attn_res_is_canonicalised(tp1):
    """The K3 pass runs on the real model's graph; vLLM's AttnRes Triton kernel (7 launches: 2 per layer
    and the output mixer) is rewritten into ATen ops, so no Triton kernel is left and the graph runs on
    CPU; the opaque forms (MoE op, KDA decode op, the MLA core) stay, one attention core per layer."""
    assert tp1["k3"]["report"] is not None
    for name in ("k3", "none"):
        assert tp1[name]["triton"] == 0, name
        c = tp1[name]["ops"]["count"]
        assert (c.get("_C::fused_kda_decode"), c.get("k3vllm::kimi_k3_mla_attention")) == (2, 1), name
    assert "vllm.moe_forward_shared.default" in tp1["k3"]["forms"]


# bf16 tolerance (relative to the output's largest value) of a compiled step against the uncompiled model, and
# at TP=2 of a rewritten graph against the unrewritten one: the rewritten tail adds this rank's rows of the
# up-projection into the shared partial before its all-reduce, vLLM adds the whole tail after (another order of
# bf16 sums)
BF16_TOL = 2e-2


def test_real_model_rewritten_graph_equals_unrewritten(tp1):
    """TP=1: the graph after the K3 passes equals the graph with none bit for bit (reference ops on CPU: the fused
    AttnRes ops follow the mixer's rounding as the graph spells vLLM's kernel, keys and mixed row in fp32, and the
    MoE rewrites are exact); the compiled step is within bf16 rounding of the uncompiled model (whose AttnRes is
    the kernel's math transcribed in PyTorch: tests/_vllm_real.py `attn_res_torch`)."""
    assert tp1["err_rewrite"] == 0.0
    assert tp1["err_vs_eager"] <= BF16_TOL


def _passes(rep):
    return {p["name"]: p for p in rep["passes"]}


def test_real_model_oproj_fuses_with_the_attn_res_residual_and_norm(tp1):
    """Layers 1 (KDA) and 2 (MLA): the o-proj GEMM, the AttnRes residual add and the post-attention mixer /
    norm (inside vLLM's AttnRes kernel, canonicalised) become k3::oproj_allreduce_residual, the mixer over
    the one block included. Layer 0 writes the AttnRes block and restarts the prefix from its attention
    output: no residual add, so no site (2 expected)."""
    rep = tp1["k3"]["report"]
    assert rep["structure"]["attention_layers"] == 2
    p = _passes(rep)["fuse_oproj_allreduce"]
    assert p["matched"] == p["expected"] == 2 and p["error"] is None, p
    oproj = [r for r in tp1["k3"]["ops"]["residual_ops"] if r[0] == "k3::oproj_allreduce_residual"]
    assert oproj == [("k3::oproj_allreduce_residual", 1, True)] * 2, oproj
    # no silent shortfall: a pass short of its expected sites says why (a near-miss, a note or a skip)
    for q in rep["passes"]:
        if q["matched"] < q["expected"]:
            assert q["near_misses"] or q["notes"] or q["skipped"], q["name"]
    assert rep["structure"]["unclassified"] is None


# per pass: the sites the real model's layer structure gives (role discovery: 2 attention layers after the
# first, KDA and MLA, 2 MoE layers in vllm::moe_forward_shared, 2 normalised layer inputs), and the named
# near-misses (not counted as expected): the MoE parts inside vLLM's op, the output mixer with no norm
SITES = {"shard_router_latent": 2, "fold_moe_finalize": 2, "fuse_oproj_allreduce": 2, "fuse_residual_norm": 2,
         "fuse_router_topk": 0, "lower_mxfp4_experts": 0, "overlap_shared_expert": 0}
NAMED = {"fuse_router_topk": ("the router's selection", 2), "lower_mxfp4_experts": ("the routed experts", 2),
         "overlap_shared_expert": ("the shared expert", 2), "fuse_residual_norm": ("no output RMSNorm", 1)}


def _check_sites(rep, tp):
    st = rep["structure"]
    assert (st["attention_layers"], st["moe_layers"], st["tp"]) == (2, 2, tp), st
    assert st["moe_ops"] == ["vllm::moe_forward_shared"], st
    p = _passes(rep)
    for name, n in SITES.items():
        assert p[name]["error"] is None and p[name]["skipped"] is None, p[name]
        assert p[name]["matched"] == p[name]["expected"] == n, p[name]
    for q in rep["passes"]:   # every pass that ran: all its expected sites
        assert q["skipped"] or q["matched"] == q["expected"], q
    for name, (what, n) in NAMED.items():
        nm = p[name]["near_misses"]
        assert len(nm) == n and all(what in m["reason"] and m["reason"].endswith("(not counted as expected)")
                                    for m in nm), nm
    for name in ("fuse_router_topk", "lower_mxfp4_experts", "overlap_shared_expert"):
        assert all("inside vllm::moe_forward_shared" in m["reason"] for m in p[name]["near_misses"])
    assert "compute_logits" in p["fuse_residual_norm"]["near_misses"][0]["reason"]
    for name in ("fold_kda_gate", "fold_mla_prologue"):   # the reference model's cores only: skipped, saying so
        assert "vLLM's own cores here, _C::fused_kda_decode, k3vllm::kimi_k3_mla_attention" in p[name]["skipped"]


# per fused residual op, the attention core of its layer (tests/_vllm_real.py `_ops`): layer 1's input and
# o-proj (KDA), layer 2's (MLA)
CORES = [("k3::residual_norm", "_C::fused_kda_decode"), ("k3::oproj_allreduce_residual", "_C::fused_kda_decode"),
         ("k3::residual_norm", "k3vllm::kimi_k3_mla_attention"),
         ("k3::oproj_allreduce_residual", "k3vllm::kimi_k3_mla_attention")]


def _check_moe_ops(ops, tp):
    """Per MoE layer one k3::router_latent_sharded over the router (8 experts) and latent (128) weights, and one
    k3::moe_latent_tail over this rank's rows of W_up [256 / tp, 128]; the KDA and the MLA layer each with
    their layer input and o-proj fused."""
    assert ops["cores"] == CORES, ops["cores"]
    c = ops["count"]
    assert c.get("k3::router_latent_sharded") == c.get("k3::moe_latent_tail") == 2, c
    assert ops["router_latent"] == [((8, 256), (128, 256), tp)] * 2, ops["router_latent"]
    assert ops["tail_w_up"] == [(256 // tp, 128)] * 2, ops["tail_w_up"]
    assert sorted(ops["residual_ops"]) == [("k3::oproj_allreduce_residual", 1, True)] * 2 + [
        ("k3::residual_norm", 1, True)] * 2, ops["residual_ops"]


def test_real_model_sites_match_per_pass_tp1(tp1):
    """TP=1: every pass matches the sites the roles give, the MLA layer's o-proj and layer input as the KDA
    layer's; the MoE parts inside vLLM's op and the output mixer are named near-misses."""
    _check_sites(tp1["k3"]["report"], 1)
    _check_moe_ops(tp1["k3"]["ops"], 1)


def test_plugin_makes_vllm_compile_kimi_k3_with_the_k3_pass():
    """The plugin route: K3_VLLM=1 and vLLM's own plugin loading give vLLM's Kimi K3 decoder vLLM's
    `support_torch_compile`, make its MLA attention core one op for Dynamo and opt out of breakable CUDA
    graphs (which turn compilation off for Kimi K3), so `CompilationConfig(mode=VLLM_COMPILE)` compiles the
    model through VllmBackend (Inductor on CPU, the batch dynamic), and vLLM's PostGradPassManager calls the
    K3 pass, which matches every site the roles give, as on the op-by-op route. Without the plugin, vLLM
    0.33 compiles nothing of this model (no decorator; breakable CUDA graphs set mode NONE)."""
    from _vllm_real import vllm_backend_worker
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_TARGET_DEVICE", "cpu")
        mp.setenv("VLLM_KIMI_K3_GEMM_AR", "0")
        r = _one(vllm_backend_worker)
    assert r["wrapped"] and r["compiled"] and r["finite"] and r["mla_opaque"]
    assert r["pass"].startswith("K3VllmPass(") and r["calls"] >= 1
    assert r["report"]["structure"]["m"] == "dynamic"
    _check_sites(r["report"], 1)


@pytest.mark.parametrize("tier", ["overlap", "column", "overlap_flashinfer"])
def test_real_model_tp2_sites_match_per_pass(tp2, tier):
    """TP=2, each latent-MoE tail of vLLM: on each rank every pass matches the sites the roles give (the o-proj
    GEMM + all-reduce + AttnRes residual + mixer; the router + latent GEMMs as 1/TP of their rows and an
    all-gather; the tail as the latent all-reduce + norm + this rank's rows of W_up added into the shared
    partial, then one all-reduce), and the rewritten graph equals the unrewritten within bf16 rounding."""
    for r in tp2:
        run = r["tiers"][tier]
        _check_sites(run["k3"]["report"], 2)
        _check_moe_ops(run["k3"]["ops"], 2)
        assert run["err_rewrite"] <= BF16_TOL and run["err_vs_eager"] <= BF16_TOL, (run["err_rewrite"], run["err_vs_eager"])
        assert run["k3"]["triton"] == run["none"]["triton"] == 0


def test_real_model_tp2_tail_reduces_the_moe_partials_only_in_the_k3_op(tp2):
    """vLLM's decode-size tail all-reduces each of its MoE op's partials on its own (the latent, then the shared
    one) and up-projects with the full W_up; its column-parallel tail all-reduces the latent on its own. In the
    rewritten graph neither partial is all-reduced alone: the latent's all-reduce is inside
    k3::moe_latent_tail, which adds this rank's rows of the tail (W_up [128, 128] of [256, 128]) into the
    shared partial, whose one all-reduce the next layer input's k3::residual_norm takes."""
    for r in tp2:
        overlap, column, fi = (r["tiers"][t] for t in ("overlap", "column", "overlap_flashinfer"))
        assert overlap["none"]["ops"]["moe_partial_all_reduces"] == 4
        assert column["none"]["ops"]["moe_partial_all_reduces"] == 2
        # FlashInfer's op all-reduces the latent (and normalises it); the shared partial on its own
        assert fi["none"]["ops"]["moe_partial_all_reduces"] == 2
        assert fi["none"]["ops"]["count"].get("vllm::flashinfer_trtllm_fused_allreduce_norm") == 2
        assert "vllm::flashinfer_trtllm_fused_allreduce_norm" not in fi["k3"]["ops"]["count"]
        for run in (overlap, column, fi):
            assert run["k3"]["ops"]["moe_partial_all_reduces"] == 0
            assert run["k3"]["ops"]["tail_w_up"] == [(128, 128)] * 2


def test_plugin_on_an_unsupported_vllm_is_one_error_line():
    """K3_VLLM=1 with a vLLM whose version the hook does not support: one logged line naming the supported
    version, no traceback, and the plugin installs nothing."""
    import subprocess
    code = ("import logging, sys; logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
            "import vllm; vllm.__version__ = '0.34.0'\n"
            "from k3compile.integrations.vllm_plugin import register; register()\n"
            "from vllm.config import CompilationConfig\n"
            "print('post_grad_custom_post_pass' in CompilationConfig().inductor_compile_config)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "K3_VLLM": "1", "VLLM_TARGET_DEVICE": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "False"
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("k3:")]
    assert len(lines) == 1 and "supports vLLM 0.33.x" in lines[0] and "found vLLM 0.34.0" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
