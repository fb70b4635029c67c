"""`k3c`: the pass-by-pass debugging CLI (`k3c --help`; the README's CLI section).

Dependencies point one way: cli -> backend (compiler, passes.manager) -> passes; the model
knows nothing of the compiler.
"""
from .app import app, main

__all__ = ["app", "main"]
