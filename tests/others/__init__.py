"""Independent Kimi K3 decoder implementations written from /work/shared/K3-SPEC.md.

Three styles (hf_style, functional, fused) compute the same function from the same full weights
(weights.py); run.py drives them eagerly / compiled, at world 1 or world 2 (gloo).
"""
