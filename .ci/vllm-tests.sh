#!/usr/bin/env bash
# CI step 2 (run inside the venv of step 1): the vLLM hook against the real vLLM 0.33.0, i.e. the
# tests marked `vllm` (step 1 excludes them). vLLM installs with --no-deps on the CPU torch, plus only
# the packages its compilation/config modules import (.ci/vllm-deps.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q --no-deps vllm==0.33.0 && pip install -q -r .ci/vllm-deps.txt && python -m pytest -q -m vllm
