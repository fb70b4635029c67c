"""GPU implementations behind the `k3::` ops, by family: `comm` (one-shot communication over symmetric
memory), `gemm` (decode GEMV / MMA), `moe` (router top-k, shared expert, MXFP4 experts on Triton or
CuTe), `attention` (KDA and MLA decode). Each family registers its CUDA kernels (`registry.register`)
beside its launchers; `dispatch` picks one per call (importing the families lazily on first CUDA use);
`tuning` holds every measured number they dispatch on."""
