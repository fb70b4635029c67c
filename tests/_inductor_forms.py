"""The graph a GPU compile hands the K3 passes, on a CPU: Inductor's own graph passes, no codegen.

`torch.compile(fn, backend=backend(gpu=True))` AOT-traces with Inductor's decompositions, runs
Inductor's joint-graph passes and post-grad passes with the K3 pass manager in their
`post_grad_custom_post_pass` slot (as `backend="k3"` does), then runs the graph op by op (the k3
ops' CPU references, as k3's eager mode). k3's eager mode runs the passes on the AOT graph
alone: the forms Inductor's passes make never reach them there.

gpu=True takes Inductor's device-dependent rewrites as they are taken for CUDA tensors
(`gpu_forms`): the graphs are the ones an H100 compile gives, up to the decompositions
(torch/_inductor/decomposition.py's mm / bmm / addmm rules, which read the tensors' device
themselves: their CUDA side only rewrites GEMMs with K = 1, none in K3).
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch


@contextlib.contextmanager
def gpu_forms():
    """Inductor's graph rewrites that read the device, taken as for CUDA tensors on CPU ones:
    - joint_graph.bmm_to_mm (torch/_inductor/fx_passes/joint_graph.py): a bmm of batch 1 becomes
      `mm(a.squeeze(0), b.squeeze(0)).unsqueeze(0)`, only where `check_device(a, b, get_gpu_type())`;
    - post_grad.should_prefer_unfused_addmm (torch/_inductor/fx_passes/post_grad.py): on a GPU
      (`is_gpu`), `mm + add` whose users are all pointwise stays unfused (post_grad's `addmm` pattern
      folds the others, on every device)."""
    from torch._inductor.fx_passes import joint_graph, post_grad
    with mock.patch.object(joint_graph, "get_gpu_type", lambda: "cpu"), \
            mock.patch.object(post_grad, "is_gpu", lambda device: True):
        yield


def backend(gpu: bool = True, observer=None, **options):
    """A torch.compile backend: the K3 passes over Inductor's post-grad graph (as for CUDA tensors
    where gpu=True), then the graph op by op. observer: the PassManager's (stage, pass, graph) hook."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import detect_fake_mode
    from torch._inductor import config as ic
    from torch._inductor.compile_fx import _recursive_joint_graph_passes, _recursive_post_grad_passes
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V

    from k3compile.options import K3Options
    from k3compile.passes.manager import PassManager

    opts = K3Options.make(**options)

    def compile_(gm, example_inputs):
        mgr = PassManager(opts, name="inductor-forms", observer=observer)

        def fw(g, inputs):
            dev = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
            with (gpu_forms() if gpu else contextlib.nullcontext()), V.set_fake_mode(detect_fake_mode(inputs)), \
                    ic.patch(post_grad_custom_post_pass=mgr, shape_padding=False):
                g = _recursive_joint_graph_passes(g, input_device=dev)
                _recursive_post_grad_passes(g, is_inference=True)
            g.recompile()
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=fw, decompositions=select_decomp_table())(gm, example_inputs)

    return compile_
