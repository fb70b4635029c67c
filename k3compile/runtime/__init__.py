"""Runtime pieces the GPU kernels use: side streams and events (streams.py), symmetric-memory workspaces
(symm.py). Their state changes only through these functions."""
