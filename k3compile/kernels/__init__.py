"""GPU implementations behind the `k3::` ops. `registry` is the dispatch table the ops consult;
`cuda` registers the CUDA implementations (imported lazily on first CUDA use)."""
