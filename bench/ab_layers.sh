#!/bin/bash
# Before / after a change, in one device call: the per-layer bench (bench/layer_bench.py, TP=8 per-rank
# widths, one GPU, M = 1 and 16) of the tree in ab_base/ (the commit before the change:
# `git archive BASE | tar -x -C ab_base`, carried with the call, never committed) and of the working
# tree, alternating base / head per layer so that drift hits both alike.
#   bench/ab_layers.sh [kda mla]      results: $OUT/ab_{base,head}_{kda,mla}.json, logs beside them
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
for layer in "${@:-kda mla}"; do
  for side in base head; do
    dir=$PWD; [ "$side" = base ] && dir=$PWD/ab_base
    ( cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} timeout ${AB_STEP_S:-240} python3 bench/layer_bench.py \
        --layer "$layer" --shapes tp8 --world 1 --ms 1,16 --ablate 0 --rounds 3 --out "$OUT/ab_${side}_${layer}.json" \
        > "$OUT/ab_${side}_${layer}.log" 2>&1 )
    echo "$side $layer rc=$?"; grep -E "M=(1|16) " "$OUT/ab_${side}_${layer}.log" | cut -c1-200
  done
done
