"""Runtime pieces the GPU kernels use: side streams and events, the PDL trigger note one op call leaves for the
next (streams.py), symmetric-memory workspaces (symm.py). Their state changes only through these functions."""
