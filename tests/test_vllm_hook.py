"""The vLLM hook's parts that need no vLLM (default suite): errors without a supported vLLM, the
plugin's off switch, compile-range gating in the pass manager, and vLLM's fused add + RMSNorm op
forms (look-alike ops with vLLM 0.33's schemas, tests/styles.py). The hook against the real vLLM
package: tests/test_vllm.py (marker `vllm`). Tolerance: the rewrite is checked bit-exactly (0)."""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch

import k3compile
from k3compile.distributed import run_ranks
from k3compile.model import K3Config, K3Model
from k3compile.options import K3Options

sys.path.insert(0, os.path.dirname(__file__))
from _compiler_ranks import compiled_vs_eager  # noqa: E402
from test_compiler import _expect_full_match  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(__file__))


def _py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("module", ["k3compile.integrations.vllm", "k3compile_vllm"])
def test_without_vllm_the_error_names_the_extra(module):
    r = _py(f"import sys\nsys.modules['vllm'] = None  # as if vLLM were not installed\nimport {module}")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: k3compile's vLLM hook needs vLLM"), last
    assert "pip install 'k3compile[vllm]'" in last and "vllm==0.33.0" in last


def test_unsupported_vllm_version_is_a_clear_error():
    r = _py("import sys, types\nfake = types.ModuleType('vllm'); fake.__version__ = '0.32.0'\n"
            "sys.modules['vllm'] = fake\nimport k3compile.integrations.vllm")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert ("UnsupportedVllmVersion: k3compile's vLLM hook supports vLLM 0.33.x (tested with 0.33.0); "
            "found vLLM 0.32.0") in last, last


def test_version_check():
    from k3compile.integrations.vllm_version import check_version  # imports no vLLM
    for ok in ("0.33.0", "0.33.4", "0.33.1.dev12+g0123abc"):
        check_version(ok)
    for bad in ("0.32.0", "0.34.0", "1.33.0", "dev"):
        with pytest.raises(ImportError, match=f"supports vLLM 0.33.x .*found vLLM {bad}"):
            check_version(bad)


def test_plugin_does_nothing_without_k3_vllm():
    r = _py("import os, sys\nos.environ.pop('K3_VLLM', None)\n"
            "from k3compile.integrations.vllm_plugin import register, enabled\nregister()\n"
            "print(enabled(), 'vllm' in sys.modules, 'k3compile.integrations.vllm' in sys.modules)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "False", "False"]


def test_plugin_entry_point_is_installed():
    from importlib.metadata import entry_points
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "k3compile"]
    assert ep.value == "k3compile.integrations.vllm_plugin:register"


def _compile_with_range(compile_range, m_ranges, M=3):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    from k3compile.passes.manager import PassManager
    opts = K3Options.make(m_ranges=m_ranges)

    def fw(g, _):
        PassManager(opts, compile_range=compile_range)(g.graph)
        g.recompile()
        return make_boxed_func(g.forward)
    m = K3Model(K3Config.tiny(dtype="bfloat16", num_layers=4))
    ids = torch.zeros(M, 1, dtype=torch.long)
    ref = m(ids, m.new_cache(M))
    be = aot_autograd(fw_compiler=fw, decompositions=select_decomp_table())
    out = torch.compile(m, backend=be, fullgraph=True)(ids, m.new_cache(M))
    assert torch.equal(out, ref)
    return k3compile.last_report()


def test_pass_manager_skips_passes_whose_range_does_not_contain_the_compile_range():
    ranges = {"fuse_oproj_allreduce": (1, 16), "fold_moe_finalize": (1, 8), "overlap_shared_expert": (4, 64)}
    rep = _compile_with_range((1, 16), ranges)
    assert rep.get("fuse_oproj_allreduce").matched == 4 and rep.get("fuse_oproj_allreduce").skipped is None
    assert rep.get("fold_moe_finalize").skipped == "compile range [1, 16] is not inside this pass's batch range [1, 8]"
    # M=3 is below this range too: the static-M check speaks first
    assert rep.get("overlap_shared_expert").skipped == "M=3 is outside this pass's batch range [4, 64]"
    rep = _compile_with_range(None, ranges)  # no compile range (plain torch.compile): only M decides
    assert rep.get("fold_moe_finalize").matched == 3


def _spawned(fn, *args):
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result(timeout=600)


@pytest.mark.parametrize("style,tp", [("vllm_add_norm", 1), ("vllm_c_v1", 2), ("vllm_c_v2", 1)])
def test_vllm_fused_add_norm_forms_fully_match(style, tp):
    """vLLM's add + RMSNorm as vllm_ir.fused_add_rms_norm, and as the in-place _C op in
    auto_functionalized v1 (vLLM's Inductor config) / v2 (torch's default)."""
    res = run_ranks(compiled_vs_eager, 2, [1, 3], ["all"], 4, style) if tp == 2 else \
        [_spawned(compiled_vs_eager, 0, 1, [1, 3], ["all"], 4, style)]
    for rank_res in res:
        r = rank_res["all"]
        assert r["err"] == 0.0, r["err"]
        assert r["compiles"] == 2
        _expect_full_match(r["passes"], tp=tp)
