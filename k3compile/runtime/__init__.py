"""Runtime pieces the GPU kernels use: side streams and events (symmetric memory comes with the GPU lowering)."""
