"""vLLM general plugin (entry point `vllm.general_plugins: k3compile`): `K3_VLLM=1` turns the hook on.

vLLM calls `register()` in every process it starts (API server, engine core, workers) before it
builds its configs from the engine arguments. With K3_VLLM unset (or 0) it does nothing and imports
nothing; with K3_VLLM=1 every `CompilationConfig` made afterwards in the process carries the K3
pass in `inductor_compile_config["post_grad_custom_post_pass"]` (mode VLLM_COMPILE runs it; the
K3_PASSES / K3_SKIP / K3_STRICT variables configure it), unless one is configured there already, and
vLLM's Kimi K3 decoder class gets vLLM's `support_torch_compile` (it has none in vLLM 0.33), so
VLLM_COMPILE compiles it, its MLA attention core one op for Dynamo (`vllm.opaque_kimi_k3_mla`). An
unsupported vLLM version is one logged error line; vLLM then runs without K3.
"""
from __future__ import annotations

import os


def enabled() -> bool:
    return os.environ.get("K3_VLLM", "").strip().lower() not in ("", "0", "false", "no", "off")


def register() -> None:
    if not enabled():
        return
    import logging

    from .vllm_version import UnsupportedVllmVersion
    try:
        from .vllm import compile_kimi_k3, install_config_hook
    except UnsupportedVllmVersion as e:   # one line, no traceback; vLLM then runs without the K3 pass
        logging.getLogger("k3compile").error("k3: K3_VLLM=1 ignored: %s", e)
        return
    install_config_hook()
    if compile_kimi_k3() and "VLLM_USE_BREAKABLE_CUDAGRAPH" not in os.environ:
        # vLLM 0.33 turns breakable CUDA graphs on for Kimi K3 by default, and with them compilation off
        # (mode NONE): the K3 pass would never run. Opt out, as vLLM's own message says to.
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
        logging.getLogger("k3compile").info("k3: VLLM_USE_BREAKABLE_CUDAGRAPH=0 so that VLLM_COMPILE compiles Kimi K3")
