"""Top-level names for vLLM configs that name their pass by string.

vLLM resolves `inductor_passes` values as `__import__(module).__dict__[attr]`, i.e. only
`module.attr` with `module` a top-level module, so the pass object lives here:

    vllm serve ... --compilation-config '{"inductor_passes": {"post_grad_custom_post_pass": "k3compile_vllm.k3_pass"}}'

`k3_pass` takes its options from the K3_PASSES / K3_SKIP / K3_STRICT environment variables at import.
Importing this module needs vLLM (`pip install 'k3compile[vllm]'`).
"""
from k3compile.integrations.vllm import K3VllmPass, make_pass

k3_pass = make_pass()

__all__ = ["k3_pass", "make_pass", "K3VllmPass"]
