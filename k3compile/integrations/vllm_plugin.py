"""vLLM general plugin (entry point `vllm.general_plugins: k3compile`): `K3_VLLM=1` turns the hook on.

vLLM calls `register()` in every process it starts (API server, engine core, workers) before it
builds its configs from the engine arguments. With K3_VLLM unset (or 0) it does nothing and imports
nothing; with K3_VLLM=1 every `CompilationConfig` made afterwards in the process carries the K3
pass in `inductor_compile_config["post_grad_custom_post_pass"]` (mode VLLM_COMPILE runs it; the
K3_PASSES / K3_SKIP / K3_STRICT variables configure it), unless one is configured there already.
"""
from __future__ import annotations

import os


def enabled() -> bool:
    return os.environ.get("K3_VLLM", "").strip().lower() not in ("", "0", "false", "no", "off")


def register() -> None:
    if not enabled():
        return
    from .vllm import install_config_hook
    install_config_hook()
