#!/bin/bash
# One device call, many steps: bench/gpu_steps.sh STEP [STEP...]  (env: K3_MS, K3_ABLATE and
# K3_LB_EXTRA (more flags: --pdl, --attribute, --gemv-table F) for the layer steps, K3_VARIANTS for the expert steps)  (run from the repo root on the
# GPU machine). The results name the commit from .k3_commit (here, before the call:
# `git rev-parse --short HEAD > .k3_commit`, and carry it: it is git-ignored) or K3_COMMIT. Each step's output goes
# to $OUT/r/STEP.log (JSON results beside it) and one summary line (rc, seconds) to
# $OUT/r/summary.txt; everything comes back as $OUT/results.tgz (the device returns <= 8 files).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export K3_CUTE_DIR=${K3_CUTE_DIR:-$PWD/build/cute}
R=$OUT/r
mkdir -p "$R"
# installed (not just importable from the repo root): backend="k3" and the k3c script come from its entry points
python3 -c "import importlib.metadata as m; m.distribution('k3compile')" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . > "$R/install.log" 2>&1
nvidia-smi -L > "$R/gpus.txt" 2>&1
step() {
  local name=$1 t=$2
  shift 2
  local s
  s=$(date +%s)
  timeout "$t" "$@" > "$R/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - s ))s" | tee -a "$R/summary.txt"
  tar czf "$OUT/results.tgz" -C "$OUT" r  # after every step: a call cut short still returns the finished ones
}
XV=${K3_VARIANTS:-v2b,v3}  # MXFP4 expert variants the experts / sweep8 steps time
LB="python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16,64,256} --ablate ${K3_ABLATE:-1} ${K3_LB_EXTRA:-}"
for st in "$@"; do
  case $st in
    # the GPU tests of the fp32 router and the split gate / up shared expert
    newtests) step new_gpu_tests 150 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "fp32_logits or separate_gate" ;;
    # the user command: a 3 KDA + 1 MLA step at TP=8 per-rank widths, eager / Inductor / k3
    kbench) step k3c_bench 300 python3 -m k3compile.cli bench --layers 3kda,1mla --tp 8 --ms ${K3_MS:-1,16,64} --rounds 3 --out "$R/k3c_bench.json" ;;
    # one layer of tests/others/fused.py against the reference's (issue 52's GPU check)
    others) step others_layer 200 python3 bench/others_layer_bench.py --ms 1,16 --rounds 3 --out "$R/others_layer.json" ;;
    tests) step gpu_tests 420 python3 -m pytest -m gpu -q -rA tests/ ;;
    tp2) step tp2_tests 240 python3 -m pytest -m gpu -q -rA -s tests/test_gpu.py -k tp2 ;;  # the two-GPU tests only
    flatests) step fla_tests 420 python3 -m pytest -m gpu -q -rA -s --durations=0 tests/test_attention_ops.py ;;
    experts) step experts8 150 python3 bench/experts_bench.py --variants $XV --no-reference-time \
               --shapes tp8 --ms 1,4,16,64 --out "$R/experts_tp8.json"
             step experts2 100 python3 bench/experts_bench.py --variants $XV --no-reference-time \
               --shapes tp2 --ms 1,16 --out "$R/experts_tp2.json" ;;
    sweep8) step sweep8 200 python3 bench/experts_bench.py --variants $XV --sweep --shapes tp8 --ms 1,16 \
              --no-reference-time --out "$R/experts_sweep_tp8.json" ;;
    # the CuTe DSL JIT path: the DSL's wheels (97 MB) exceed one call's 64 MiB, so the big one travels
    # in two parts: build/dslA (carried by the call before, left on the warm machine: build/ is
    # git-ignored) and build/dslB (this call)
    cutejit) W=/tmp/whl/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
             ls -la build/dslA build/dslB > "$R/dsl_install.log" 2>&1
             mkdir -p /tmp/whl && cat build/dslA/cu13.part1 build/dslB/cu13.part2 > $W && cp build/dslB/*.whl /tmp/whl/ \
               && (cd /tmp/whl && sha256sum -c "$OLDPWD/build/dslB/cu13.sha256") >> "$R/dsl_install.log" 2>&1 \
               && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                    --target /tmp/site /tmp/whl/*.whl >> "$R/dsl_install.log" 2>&1
             echo "dsl install rc=$?" | tee -a "$R/summary.txt"
             # the wheel's .pth (adding dsl_packages) is not read from a PYTHONPATH directory
             step cute_jit 240 env PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages \
               python3 -m pytest -m gpu -q -rA -s tests/test_gpu_cute.py -k just_in_time ;;
    # fla-core for the KDA ops (prefill chunk_kda; decode fused_recurrent_kda): its wheel in .whl/ (README of
    # the device: pip download --no-deps fla-core==0.6.0; einops is on the GPU machine); the steps after it
    # in this invocation import it (the model's KDA ops use it wherever it imports)
    fla) python3 -m pip install -q --no-index --no-deps --target /tmp/fla .whl/fla_core-*.whl > "$R/fla_install.log" 2>&1
         echo "fla install rc=$?" | tee -a "$R/summary.txt"
         export PYTHONPATH=/tmp/fla${PYTHONPATH:+:$PYTHONPATH} ;;
    # the GPU tests of the norm kernels' rounding orders and the MLA prologue's cast-first norm
    rounding) step gpu_rounding 200 python3 -m pytest -m gpu -q -rA tests/test_gpu_rounding.py ;;
    gemvchain) step gemv_chain 120 python3 bench/gemv_bench.py --chain bench/results/gemv_sweep_h200x2_e2f234a.json \
                 --ms 1,4 --out "$R/gemv_chain.json" ;;
    gemv) step gemv 200 python3 bench/gemv_bench.py --out "$R/gemv.json" ;;
    # tuning.GEMV_TABLE's picks (tuned decode GEMM or cuBLAS) against cuBLAS, alternating, 3 repeats
    dispatch) step gemv_dispatch 240 python3 bench/gemv_bench.py --dispatch --ms ${K3_MS:-1,2,4,8,16} \
                --out "$R/gemv_dispatch.json" ;;
    # the TP=1 shapes of the world-1 layers (router, latent down and up, whole) through the MMA sweep
    w1gemv) step gemv_w1 200 python3 bench/gemv_bench.py --precompile 12 --ms ${K3_MS:-1,4,16} \
              --shapes "w1 router,w1 latent,w1 latent_up" --out "$R/gemv_w1.json" ;;
    # the all-reduce + residual + norm kernel's warps (K3_KNOBS ar_warps; 0 = by width) at group sizes 2 and 8,
    # one GPU with simulated peers: the layer-input op and the o-proj op
    arwarps) for w in 0 16 32; do
               step "arwarps$w" 120 env K3_KNOBS=ar_warps=$w python3 bench/comm_sim_bench.py --ops resnorm,oproj \
                 --worlds 2,8 --ms ${K3_MS:-1,16} --blocks 3 --out "$R/arwarps$w.json"
             done ;;
    # the all-reduce + norm kernel's LEAN form and warps (comm_sim_bench's AR_VARIANTS), both ops with 3
    # AttnRes blocks, then its GPU tests (the reference at TP=1, simulated peers)
    arlean) step ar_lean 150 python3 bench/comm_sim_bench.py --ops resnorm,oproj --worlds 1,2,8 --ms ${K3_MS:-1,16} \
              --blocks 3 --oproj-blocks 3 --out "$R/ar_lean.json"
            step ar_lean_tests 200 python3 -m pytest -m gpu -q -rA tests/test_gpu.py \
              -k "kernels_match_reference_tp1 or simulated_peers" ;;
    # the MLA layer at TP=8 widths on one GPU with the op's PyTorch reference in every mode instead of the
    # Triton MLA decode (K3_KNOBS=mla_triton=0; compare with an mla1 step of the same call), after its GPU test
    mlaref) step mla_triton_tests 200 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k mla_decode
            step layer_mla_tp8_w1_ref 300 env K3_KNOBS=mla_triton=0 $LB --world 1 --layer mla --shapes tp8 \
              --out "$R/layer_mla_tp8_w1_ref.json" ;;
    # the all-reduce / norm kernel's joint AttnRes reductions (AR_VARIANTS k3_seq: one source after another)
    # and the latent tail at group sizes 1 and 8 (simulated peers), 3 blocks on both ops; then the GPU
    # tests of those kernels and of the decode GEMM
    joint) step ar_joint 200 python3 bench/comm_sim_bench.py --ops resnorm,oproj,tail --worlds 1,8 --ms ${K3_MS:-1,16} \
             --blocks 3 --oproj-blocks 3 --out "$R/ar_joint.json"
           step joint_tests 240 python3 -m pytest -m gpu -q -rA tests/test_gpu.py \
             -k "kernels_match_reference_tp1 or simulated_peers or mma_gemm" ;;
    # the MLA decode alone: the op's reference and the Triton kernel's split / tile / warp settings
    mlasweep) step mla_sweep 200 python3 bench/mla_bench.py --ms ${K3_MS:-1,4,16} --out "$R/mla_sweep.json" ;;
    # the all-reduce / norm kernel at group size 8, one row: joint or one by one, by warps (simulated peers)
    arw8) step ar_w8 150 python3 bench/comm_sim_bench.py --ops resnorm,oproj --worlds 8 --ms 1 --blocks 3 \
            --oproj-blocks 3 --out "$R/ar_w8.json" ;;
    # the KDA short conv pass: its kernel's GPU test, then the KDA layer with its ablation rows
    kdaconv) step kda_conv_tests 120 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "kda_conv or tp1"
             step layer_kda_tp8_w1_conv 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate ${K3_ABLATE:-1,4,16} \
               --ablate-passes fold_kda_conv --world 1 --layer kda --shapes tp8 --out "$R/layer_kda_tp8_w1_conv.json" ;;
    mlatests) step mla_tests 120 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "mla or reduce_overhead or tp1" ;;
    # test_gpu.py only; a test still running after 120 s dumps every thread's stack into the log
    gputest) step gpu_tests_main 420 python3 -m pytest -m gpu -q -rA --durations=25 -o faulthandler_timeout=120 tests/test_gpu.py ;;
    # the reduce-overhead test that once ran past 420 s, with each of the later KDA folds skipped in
    # turn, 100 s each, stacks after 60 s
    hang) for sk in none fold_kda_onorm fold_kda_step fold_kda_fb; do
            step "hang_$sk" 100 env K3_SKIP=$([ $sk = none ] || echo $sk) python3 -m pytest -m gpu -q -rA -x \
              -o faulthandler_timeout=60 tests/test_gpu.py -k reduce_overhead_uses_cuda_graphs
          done ;;
    # the whole suite ran past 420 s at a63d1af on an H100 (28 tests done; the next was the v3g MXFP4 test, which
    # passed at 1347e6d): the MXFP4 expert tests after the grid-barrier test, stacks after 60 s, then again alone
    v3ghang) step v3g_after_cols 150 python3 -m pytest -m gpu -q -rA -x -o faulthandler_timeout=60 tests/test_gpu.py \
               -k "column_split or mxfp4_expert_kernels"
             step v3g_alone 120 python3 -m pytest -m gpu -q -rA -x -o faulthandler_timeout=60 tests/test_gpu.py \
               -k "mxfp4_expert_kernels" ;;
    # the 93-layer structure (tiny widths) compiled cold by Inductor on the GPU: with the k3 ops registered
    # as Inductor fallbacks first (5efaefd), then without (Inductor's implicit path and its log line)
    ct93) step compile93_cuda 300 python3 bench/compile_time_93.py --inductor --device cuda --with-passes-only \
            --out "$R/compile93_cuda.json"
          step compile93_cuda_nofb 150 python3 bench/compile_time_93.py --inductor --device cuda --with-passes-only \
            --no-fallbacks --out "$R/compile93_cuda_nofb.json" ;;
    # the rest of the GPU suite in steps that fit one call each (the whole suite in one step ran past
    # 420 s, fla's chunk kernels autotuning): the CuTe tests, and the small modules (flatests: attention)
    cutetests) step gpu_tests_cute 300 python3 -m pytest -m gpu -q -rA tests/test_gpu_cute.py ;;
    # the GPU tests of the fold modules (the KDA folds)
    foldtests) step gpu_tests_folds 300 python3 -m pytest -m gpu -q -rA --durations=10 tests/test_kda_step.py \
                 tests/test_kda_onorm.py tests/test_kda_fb.py tests/test_kda_conv.py ;;
    resttests) step gpu_tests_rest 200 python3 -m pytest -m gpu -q -rA tests/test_kda_gate.py tests/test_mla_prologue.py \
                 tests/test_vllm.py ;;
    # the tensor-core split-K decode GEMM: its GPU test, then the sweep (every MMA config of every
    # shape, compiled in 12 processes first) against cuBLAS and the CUDA-core GEMV's best two
    mmagemm) step mma_tests 120 python3 -m pytest -m gpu -q -rA -s tests/test_gpu.py -k "mma_gemm"
             step gemv_mma 420 python3 bench/gemv_bench.py --precompile 12 --ms ${K3_MS:-1,4,16} \
               ${K3_GEMV_EXTRA:-} --out "$R/gemv_mma.json" ;;
    # a GEMV table for this card: the world-1 layers' GEMM shapes swept (M = 1, 4), a table from the sweep
    # (bench/gemv_table.py: the shared gate-up keeps its side-stream entry), then both layers with it as a row
    gemvtune) step gemv_tune 300 python3 bench/gemv_bench.py --precompile 12 --ms 1,4 --shapes "tp8 oproj,tp8 shared_gate_up,\
tp8 shared_down,tp8 in_proj_kda,tp8 in_proj_mla,tp8 q_b_mla,w1 router_latent,w1 latent_up" --out "$R/gemv_tune.json"
              step gemv_table 30 python3 bench/gemv_table.py "$R/gemv_tune.json" --keep 1536x7168 --out "$R/gemv_table.json"
              for L in kda mla; do
                step layer_${L}_tp8_w1_tab 200 python3 bench/layer_bench.py --ms 1,4 --ablate 0 \
                  --env tab:K3_KNOBS=gemv_table="$R/gemv_table.json" --world 1 --layer $L --shapes tp8 \
                  --out "$R/layer_${L}_tp8_w1_tab.json"
              done ;;
    # the gemvtune sweep's M=1 winners for the two in_proj shapes one at a time inside the layer (K3_KNOBS gemv_cfg forces that
    # shape's config at every M, so M=1 only); in the other layer a shape it lacks is a control row
    # tab2: the H100 sweep's table with the stacked router + latent kept on an MMA config (gemv_table.py --mma-only)
    # bench/layout_probe.py: the same Triton read / GEMV over the row-major weight and over a tiled copy
    # ([N/BN, K/BK, BN, BK], each step one contiguous tile), beside cuBLAS, k3's dispatch and torch.sum
    layout) step layout_probe 320 python3 bench/layout_probe.py --out "$R/layout_probe.json" ;;
    # tuning.GEMV_TABLE_BY_CARD (the H100's in_proj rows at M=1): both layers at M=1, k3 against a row without them
    cardrows) for L in kda mla; do
                step layer_${L}_tp8_w1_card 150 python3 bench/layer_bench.py --ms 1 --ablate 0 --env nocard:K3_KNOBS=gemv_card=none \
                  --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_card.json"
              done ;;
    # the stacked router + latent (4480 x 7168) on the CUDA-core GEMV in one launch (mma_gemm2's TWO form; the
    # H100 sweep's best for that shape): its GPU test, then both layers at M=1 with that config forced; and the
    # shared gate-up (1536 x 7168, the H100 sweep's best alone) on the GEMV, alone and with it
    rlgemv) step rlgemv_tests 150 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "two_weights or gemv_matches"
            for L in kda mla; do
              step layer_${L}_tp8_w1_rlgemv 240 python3 bench/layer_bench.py --ms 1 --ablate 0 \
                --env "rl:K3_KNOBS=gemv_cfg=4480x7168=gemv 4/1024/4/3" --env "rl2:K3_KNOBS=gemv_cfg=4480x7168=gemv 8/512/4/3" \
                --env "sgu:K3_KNOBS=gemv_cfg=1536x7168=gemv 2/1024/4/4" \
                --env "rlsgu:K3_KNOBS=gemv_cfg=4480x7168=gemv 4/1024/4/3;1536x7168=gemv 2/1024/4/4" \
                --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_rlgemv.json"
            done ;;
    # the shared expert's GEMM configs beside the routed kernels (on the H100 the shared path ends last
    # before the latent tail): gate-up with 48 / 192 programs, shared down split in two
    sharedcfg) for L in kda mla; do
                 step layer_${L}_tp8_w1_sharedcfg 240 python3 bench/layer_bench.py --ms 1 --ablate 0 \
                   --env "sg2:K3_KNOBS=gemv_cfg=1536x7168=mmas 64/128/2/4/4" --env "sg8:K3_KNOBS=gemv_cfg=1536x7168=mmas 64/128/8/4/4" \
                   --env "sg32:K3_KNOBS=gemv_cfg=1536x7168=mma 32/128/4/4/6" --env "sd2:K3_KNOBS=gemv_cfg=7168x768=mmas 64/128/2/4/4" \
                   --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_sharedcfg.json"
               done ;;
    # the MXFP4 expert kernels' dispatch (tuned on the H200) on this card: the CuTe tags xf / untagged
    # against ldgd, the down kernel without PDL, and the Triton v3 kernels; both layers at M=1
    mxtags) for L in kda mla; do
              step layer_${L}_tp8_w1_mxtags 240 python3 bench/layer_bench.py --ms 1 --ablate 0 \
                --env xf:K3_KNOBS=cute_mxfp4_tag=xf --env untag:K3_KNOBS=cute_mxfp4_tag=none --env nopdl:K3_KNOBS=cute_pdl=0 \
                --env tv3:K3_KNOBS=mxfp4=v3 --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_mxtags.json"
            done ;;
    # gemv_kernel's LAZY form (one K sum after the loop): its GPU tests, a sweep of every CUDA-core config
    # plain and lazy beside what k3 dispatches at M=1 (no MMA configs), then both layers with each shape whose
    # best lazy config beat the dispatch by 1% forced (bench/gemv_env.py), and all of them at once
    gemvlazy) step gemvlazy_tests 200 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "two_weights or gemv_matches"
              step gemv_lazy 240 python3 bench/gemv_bench.py --all-gemv --lazy --no-mma --dispatch-column --ms 1 \
                --shapes "tp8 in_proj_kda,tp8 in_proj_mla,w1 router_latent,w1 latent_up,tp8 oproj,tp8 q_b_mla,tp8 shared_down,tp8 shared_gate_up" \
                --out "$R/gemv_lazy.json"
              mapfile -t SPECS < <(python3 bench/gemv_env.py "$R/gemv_lazy.json")
              printf '%s\n' "${SPECS[@]}" > "$R/gemv_lazy_specs.txt"
              EA=(); for sp in "${SPECS[@]}"; do EA+=(--env "$sp"); done
              if [ ${#EA[@]} -gt 0 ]; then
                for L in kda mla; do
                  step layer_${L}_tp8_w1_lazy 240 python3 bench/layer_bench.py --ms 1 --ablate 0 "${EA[@]}" \
                    --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_lazy.json"
                done
              fi ;;
    # the H100's lazy picks of the gemvlazy step together, without the shared gate-up (slower in the layer
    # on any GEMV), and the stacked router + latent alone; 5 rounds
    lazyx) LX="4480x7168=gemvl 2/1024/4/4;3648x7168=gemvl 4/1024/4/3;6284x7168=gemvl 8/512/4/3;2304x1536=gemvl 2/1024/4/4"
           for L in kda mla; do
             step layer_${L}_tp8_w1_lazyx 240 python3 bench/layer_bench.py --ms 1 --ablate 0 --rounds 5 \
               --env "lzx:K3_KNOBS=gemv_cfg=$LX" --env "lz1:K3_KNOBS=gemv_cfg=4480x7168=gemvl 2/1024/4/4" \
               --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_lazyx.json"
           done ;;
    gemvrows) T2=bench/results/gemv_table_h100_b8043ff_mma.json
              for L in kda mla; do
                step layer_${L}_tp8_w1_cfg 200 python3 bench/layer_bench.py --ms 1 --ablate 0 \
                  --env "kin:K3_KNOBS=gemv_cfg=6284x7168=gemv 2/1024/4/4" --env "qkv:K3_KNOBS=gemv_cfg=3648x7168=gemv 4/1024/4/3" \
                  --env tab2:K3_KNOBS=gemv_table=$T2 --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_cfg.json"
                step layer_${L}_tp8_w1_cfg4 200 python3 bench/layer_bench.py --ms 4 --ablate 0 --env tab2:K3_KNOBS=gemv_table=$T2 \
                  --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_cfg4.json"
              done ;;
    router) step router 90 python3 bench/router_bench.py --out "$R/router.json" ;;
    # the MLA per-head bmm's on k3's Triton kernel (k3::decode_bmm; K3_KNOBS=decode_bmm=0: torch.bmm), the
    # router top-k's rounds form (K3_KNOBS=router_sort=0), and the shared gate-up's config now that the top-k
    # beside it is shorter (192 programs, cuBLAS): GPU tests, then both layers with those variants
    # the MLA combine split over the latent's columns (K3_KNOBS mla_combine_bl, 0 = one program per head) and
    # k3::decode_bmm with the output gate folded in (token-major output): GPU tests, then both layers
    mlaout) step mlaout_tests 240 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "head_bmm or mla or tp1 or overlaps"
            for L in mla kda; do
              step layer_${L}_tp8_w1_mlaout 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate 0 \
                --env comb0:K3_KNOBS=mla_combine_bl=0 --env comb64:K3_KNOBS=mla_combine_bl=64 --env nobmm:K3_KNOBS=decode_bmm=0 \
                --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_mlaout.json"
            done ;;
    # the MLA kv_a norm (and the q_rope copy) in the attention kernel (fold_mla_prologue): its GPU tests
    # and the MLA ones, then the MLA layer with the pass's ablation rows
    mlapro) step mlapro_tests 240 python3 -m pytest -m gpu -q -rA tests/test_mla_prologue.py tests/test_gpu.py \
              -k "mla or tp1 or overlaps or shared"
            step layer_mla_tp8_w1_pro 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate ${K3_ABLATE:-1,4,16} \
              --ablate-passes fold_mla_prologue --world 1 --layer mla --shapes tp8 \
              --out "$R/layer_mla_tp8_w1_pro.json" ;;
    # the MLA folds (fold_mla_prologue, fold_mla_output): their GPU tests, then the
    # MLA layer with their ablation rows, the combine + up-projection kernel with 32 value columns as a variant
    mlafold) step mlafold_tests 240 python3 -m pytest -m gpu -q -rA tests/test_mla_prologue.py
             step layer_mla_tp8_w1_fold 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} \
               --ablate ${K3_ABLATE:-1,4,16} --ablate-passes fold_mla_prologue,fold_mla_output \
               --env uvbv32:K3_KNOBS=mla_uv_bv=32 --world 1 --layer mla --shapes tp8 --out "$R/layer_mla_tp8_w1_fold.json" ;;
    # the KDA conv state updated in place (fold_kda_conv's k3::kda_conv_decode_, Inductor reinplacing it):
    # the conv kernel tests, then the KDA layer with the functional op (K3_KNOBS=conv_inplace=0) as a row
    convip) step convip_tests 200 python3 -m pytest -m gpu -q -rA tests/test_kda_conv.py tests/test_gpu.py -k "kda_conv or tp1 or overlaps"
             step layer_kda_tp8_w1_convip 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate 0 \
               --env conv0:K3_KNOBS=conv_inplace=0 --world 1 --layer kda --shapes tp8 --out "$R/layer_kda_tp8_w1_convip.json" ;;
    # the column-split all-reduce / norm and latent-tail kernels (triton_cols, tuning.COLS): their GPU tests
    # (every form against the reference, eager and graphed; the grid barrier over 200 replays), the ops
    # with simulated peers (k3 = columns, k3_rows = the row kernels, k3_cNN = NN columns per program), and
    # both layers with the row kernels as a row (rows)
    # the expert-grouped MXFP4 kernels at the larger batches: v4g (scales in the A tile) vs v3g and
    # the CuTe GEMVs, cold routings; K3_TILES adds tile overrides
    v4g) step v4g_tests 300 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "mxfp4_expert_kernels"
         step experts_v4g 400 python3 bench/experts_bench.py --variants ${K3_VARIANTS:-cute_h2,v3g,v4g} \
           --no-reference-time --cold 8 --shapes ${K3_SHAPES:-tp8,tp2} --ms ${K3_MS:-16,32,64,128,256} \
           ${K3_TILES:+--tiles "$K3_TILES"} --out "$R/experts_v4g.json" ;;
    # v4g as the default above CuTe's range: the crossover, the layers at the large batches, its tests
    v4gfinal) step v4g_tests 200 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "mxfp4 or tp1 or overlaps"
              step experts_x 150 python3 bench/experts_bench.py --variants cute_h2,v4g --no-reference-time --cold 8 \
                --shapes tp8,tp2 --ms ${K3_XMS:-96,128,192} --out "$R/experts_x.json"
              step layer_kda_tp8_w1 200 $LB --world 1 --layer kda --shapes tp8 --out "$R/layer_kda_tp8_w1.json"
              step layer_mla_tp8_w1 200 $LB --world 1 --layer mla --shapes tp8 --out "$R/layer_mla_tp8_w1.json" ;;
    # the CuTe / v4g crossover alone (no tests): sets tuning.CUTE_M["mxfp4_experts"]
    xover) step experts_x 240 python3 bench/experts_bench.py --variants ${K3_VARIANTS:-cute_h2,v4g} --no-reference-time \
             --cold 8 --shapes tp8,tp2 --ms ${K3_XMS:-32,48,64,80,96,128} --out "$R/experts_x.json" ;;
    # the KDA gate's f_b GEMV in the recurrence kernel (fold_kda_fb) and the whole step in one kernel
    # (fold_kda_step), both gated off until measured: their GPU tests at real widths and the KDA ones, then
    # the KDA layer with them let through the gate: fb (fold_kda_fb), step (both); at M > 1 fold_kda_gate
    # and fold_kda_conv are gated off too: kda3 lets them and fold_kda_fb through, stepg all four.
    # (K3_KNOBS=kda_step_p=1 in an --env: one program per head.) Both steps fit one 600 s call: run it after `fla`
    kdafb) step kdafb_tests 150 python3 -m pytest -m gpu -q -rA tests/test_kda_fb.py tests/test_kda_step.py \
             tests/test_kda_gate.py tests/test_kda_conv.py tests/test_gpu.py -k "kda or tp1"
           step layer_kda_tp8_w1_fb 420 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate 0 \
             --env fb:K3_UNGATED=fold_kda_fb --env step:K3_UNGATED=fold_kda_fb,fold_kda_step \
             --env kda3:K3_UNGATED=fold_kda_gate,fold_kda_conv,fold_kda_fb \
             --env stepg:K3_UNGATED=fold_kda_gate,fold_kda_conv,fold_kda_fb,fold_kda_step \
             --world 1 --layer kda --shapes tp8 --out "$R/layer_kda_tp8_w1_fb.json" ;;
    # fold_kda_onorm (the KDA output norm in the step kernel): its GPU tests and the step's, then the KDA layer
    # rows with it let through (M = 1 / 4: onto the default's step; M=16: step + norm against step alone)
    onorm) step onorm_tests 150 python3 -m pytest -m gpu -q -rA tests/test_kda_onorm.py tests/test_kda_step.py
           step layer_kda_tp8_w1_onorm 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate 0 \
             --env on:K3_UNGATED=fold_kda_onorm --env step:K3_UNGATED=fold_kda_step \
             --env stepon:K3_UNGATED=fold_kda_step,fold_kda_onorm \
             --world 1 --layer kda --shapes tp8 --out "$R/layer_kda_tp8_w1_onorm.json" ;;
    # the CuTe MXFP4 experts at decode batches, cold routings, timed with and without the replay's host
    # launch hidden (rows' k3_us_hidden_launch): the 70%-of-bandwidth target's points
    xhide) step experts_hide 200 python3 bench/experts_bench.py --variants ${K3_VARIANTS:-cute_h2} --no-reference-time \
             --cold 8 --shapes tp8,tp2 --ms ${K3_XMS:-1,2,4,8,16} --out "$R/experts_hide.json" ;;
    cols) step cols_tests 240 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "simulated_peers or grid_barrier"
          step comm_sim_cols 240 python3 bench/comm_sim_bench.py --ops resnorm,oproj,tail --worlds 1,8 \
            --ms ${K3_MS:-1,4,16} --oproj-blocks 3 --variants k3,k3_rows,k3_c64,k3_c256 --out "$R/comm_sim_cols.json"
          step layer_kda_tp8_w1_cols 200 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate 0 \
            --env rows:K3_KNOBS=cols=0 --world 1 --layer kda --shapes tp8 --out "$R/layer_kda_tp8_w1_cols.json"
          step layer_mla_tp8_w1_cols 200 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate 0 \
            --env rows:K3_KNOBS=cols=0 --world 1 --layer mla --shapes tp8 --out "$R/layer_mla_tp8_w1_cols.json" ;;
    # the column-split kernels' GPU tests alone; where their time goes (bench/cols_probe.py); Nsight Compute's
    # launch statistics, occupancy and speed of light of the AttnRes form at M=4 (forced at group size 1)
    colstests) step cols_tests 240 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "simulated_peers or grid_barrier" ;;
    colsprobe) step cols_probe 240 python3 bench/cols_probe.py --out "$R/cols_probe.json" ;;
    colsncu) step cols_ncu 120 env K3_KNOBS=cols=1,cols_max_m=4 ncu --kernel-name regex:cols --launch-skip 2 --launch-count 1 \
               --section LaunchStats --section Occupancy --section SpeedOfLight python3 -c "import torch
from tests import simpeers
run = simpeers.residual_norm_case(1, 4, 3, seed=1)[0]
[run() for _ in range(4)]
torch.cuda.synchronize()" ;;
    # L2 prefetch of a decode GEMM's weight while small kernels run (bench/l2_bench.py)
    l2) step l2 240 python3 bench/l2_bench.py --ms ${K3_MS:-1,4,16} --out "$R/l2.json" ;;
    bmm) step bmm_tests 200 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "head_bmm or tp1 or overlaps"
         for L in mla kda; do
           step layer_${L}_tp8_w1_bmm 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate 0 \
             --env nobmm:K3_KNOBS=decode_bmm=0 --env rounds:K3_KNOBS=router_sort=0 \
             --env "sgu192:K3_KNOBS=gemv_cfg=1536x7168=mma 32/128/4/4/6" --env "sgucublas:K3_KNOBS=gemv_cfg=1536x7168=cublas" \
             --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_bmm.json"
         done ;;
    # the side-stream fork pinned between the router GEMM and its top-k (the default) against unpinned
    # (K3_KNOBS=pin_fork=0), and the router top-k's bitonic form (K3_KNOBS=router_sort=1): the GPU tests of the ops
    # touched, the top-k alone, the all-reduce / norm kernels at group size 1, then both layers
    pin) step pin_tests 300 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "tp1 or side_stream or overlaps"
         step router 90 python3 bench/router_bench.py --ms 1,4,16 --out "$R/router.json"
         step ar_w1 150 python3 bench/comm_sim_bench.py --ops resnorm,oproj,tail --worlds 1 --ms ${K3_MS:-1,16} \
           --blocks 3 --oproj-blocks 3 --out "$R/ar_w1.json"
         for L in kda mla; do
           step layer_${L}_tp8_w1_pin 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate 0 \
             --env nopin:K3_KNOBS=pin_fork=0 --env sort:K3_KNOBS=router_sort=1 --world 1 --layer $L --shapes tp8 \
             --out "$R/layer_${L}_tp8_w1_pin.json"
         done ;;
    # the shared expert beside the routed path at M=1: inline (the ablation row without
    # overlap_shared_expert) and its gate-up GEMM on the MMA kernel with 96 / 192 programs instead of
    # cuBLAS's split-K (which, beside the one-program router top-k, made that kernel 4x slower in KDA)
    sharedmma) for L in kda mla; do
                 step layer_${L}_tp8_w1_sharedmma 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} \
                   --ablate ${K3_ABLATE:-1} --ablate-passes overlap_shared_expert \
                   --env "sgu96:K3_KNOBS=gemv_cfg=1536x7168=mmas 64/128/4/4/4" \
                   --env "sgu192:K3_KNOBS=gemv_cfg=1536x7168=mma 32/128/4/4/6" --world 1 --layer $L --shapes tp8 \
                   --out "$R/layer_${L}_tp8_w1_sharedmma.json"
               done ;;
    # both layers at M = 1..16 with k3's replay timeline (layer_bench rows' "timeline"), the KDA conv's
    # block as env variants
    timeline) step layer_kda_tp8_w1_tl 240 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate 0 \
                --env conv256:K3_KNOBS=conv_block=256 --env conv128:K3_KNOBS=conv_block=128 --world 1 --layer kda --shapes tp8 \
                --out "$R/layer_kda_tp8_w1_tl.json"
              step layer_mla_tp8_w1_tl 240 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate 0 --world 1 \
                --layer mla --shapes tp8 --out "$R/layer_mla_tp8_w1_tl.json" ;;
    # the router + latent down-projection as one GEMM at TP=1 (shard_router_latent), the KDA conv's block,
    # int32 router ids: GPU tests, the stacked shape's sweep beside the two alone, then both layers with
    # the pass's ablation rows (and the conv block as env variants)
    onegemm) step onegemm_tests 240 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "tp1 or mma_gemm or kda_conv"
             step gemv_w1_stacked 240 python3 bench/gemv_bench.py --precompile 12 --ms ${K3_MS:-1,4,16} \
               --shapes "w1 router_latent,w1 router,w1 latent" --out "$R/gemv_w1_stacked.json"
             step layer_kda_tp8_w1_onegemm 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate ${K3_ABLATE:-1,4,16} \
               --ablate-passes shard_router_latent --env conv128:K3_KNOBS=conv_block=128 --env conv256:K3_KNOBS=conv_block=256 \
               --world 1 --layer kda --shapes tp8 --out "$R/layer_kda_tp8_w1_onegemm.json"
             step layer_mla_tp8_w1_onegemm 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16} --ablate ${K3_ABLATE:-1,4,16} \
               --ablate-passes shard_router_latent --world 1 --layer mla --shapes tp8 \
               --out "$R/layer_mla_tp8_w1_onegemm.json" ;;
    sass) step sass 120 python3 bench/sass_count.py mxfp4_v2b mxfp4_v3 ;;  # this machine's Triton
    ops) step ops_seq 120 python3 bench/ops_bench.py --out "$R/ops_seq.json" ;;
    ops_cold) step ops_cold 80 python3 bench/ops_bench.py --cold 8 --out "$R/ops_cold8.json" ;;
    ops_cas) step ops_cas 120 env K3_KNOBS=barrier_seq=0 python3 bench/ops_bench.py --out "$R/ops_cas.json" ;;
    cutemoe) step cute_moe_tests 150 python3 -m pytest -m gpu -q -rA -s tests/test_gpu_cute.py -k mxfp4
             step cute_moe8 150 python3 bench/experts_bench.py --variants ${K3_VARIANTS:-v3,cute,cute_h2} \
               --no-reference-time --shapes tp8 --ms 1,4,16,64 --out "$R/experts_cute_tp8.json" ;;
    # the CuTe experts with the same routing every call (as every earlier experts run) and with 8
    # routings in turn (cold: no L2 reuse between calls)
    expcold) for c in 1 8; do
               step experts_cold$c 150 python3 bench/experts_bench.py --variants ${K3_VARIANTS:-cute_h2} \
                 --no-reference-time --cold $c --shapes tp8,tp2 --ms ${K3_MS:-1,4,16} --out "$R/experts_cold$c.json"
             done ;;
    # the CuTe f16x2 experts' variants (build --alt: xf, m32, sh, dn2x, none = untagged) against the default, cold
    # routings; their GPU tests first
    alt) step alt_tests 300 python3 -m pytest -m gpu -q -rA -s tests/test_gpu_cute.py -k mxfp4
         step experts_alt 300 python3 bench/experts_bench.py \
           --variants ${K3_VARIANTS:-cute_h2,cute_h2@none,cute_h2@xf,cute_h2@sh} --no-reference-time \
           --cold 8 --shapes tp8,tp2 --ms ${K3_MS:-1,2,4,8,16,64} --out "$R/experts_alt.json" ;;
    # the MXFP4 experts at small batches: each CuTe kernel alone, the pair with / without PDL, and
    # Triton kernels that only read the same bytes (one kernel, two, contiguous)
    # skewed routing: each token's top-16 from a pool of 32 (then 128) experts
    skew) for pool in 32 128; do
            step experts_pool$pool 150 python3 bench/experts_bench.py --variants ${K3_VARIANTS:-cute_h2,v3} \
              --no-reference-time --cold 8 --pool $pool --shapes tp8,tp2 --ms ${K3_MS:-4,16,64} \
              --out "$R/experts_pool$pool.json"
          done ;;
    # the expert-grouped Triton kernels (v3g) against the per-pair ones: GPU tests, then uniform and
    # skewed routing (K3_TILES: experts_bench --tiles JSON)
    grouped) step grouped_tests 240 python3 -m pytest -m gpu -q -rA -s tests/test_gpu.py -k mxfp4_expert_kernels
             for pool in 0 32; do
               step experts_grouped_pool$pool 300 python3 bench/experts_bench.py --variants ${K3_VARIANTS:-cute_h2,v3,v3g} \
                 --tiles "${K3_TILES:-{\}}" --no-reference-time --cold 8 --pool $pool --shapes tp8,tp2 \
                 --ms ${K3_MS:-4,16,64,256} --out "$R/experts_grouped_pool$pool.json"
             done ;;
    # K3_PROBE_TAGS: variants timed beside the default (--tags), K3_PROBE_EXTRA more flags (--no-read)
    probe) step experts_probe 240 python3 bench/experts_probe.py --ms ${K3_MS:-1,2,4} --tags "${K3_PROBE_TAGS:-}" \
             ${K3_PROBE_EXTRA:-} --out "$R/experts_probe.json" ;;
    # Nsight Compute on the CuTe expert kernels (gate-up and down of the 3rd call; hardware counters
    # on Firecracker machines; K3_NCU_CASES: "variant:shape:M ...")
    ncu) for c in ${K3_NCU_CASES:-cute_h2:tp8:16 cute_h2:tp2:1 cute_h2:tp8:1}; do
           IFS=: read -r v sh m <<< "$c"
           step "ncu_${v//@/_}_${sh}_m$m" 120 ncu --clock-control none --kernel-name regex:mxfp4 --launch-skip 4 \
             --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats \
             --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
             python3 bench/ncu_experts.py --variant "$v" --shape "$sh" --m "$m" --calls 8
         done ;;
    pdl) step experts_pdl 150 python3 bench/experts_bench.py --variants cute_h2_nopdl,cute_h2,cute_h2,cute_h2_nopdl \
           --no-reference-time --shapes tp8,tp2 --ms 1,2,4,8,16 --out "$R/experts_pdl.json" ;;
    # the CuTe push-epilogue o-proj: its GPU tests (and the refactored skinny GEMM's), then the op
    # timed against the pull path, cold weights, 3 AttnRes blocks as in the layer bench
    push) step push_tests 240 python3 -m pytest -m gpu -q -rA -s tests/test_gpu.py tests/test_gpu_cute.py -k "push or skinny"
          step ops_push 240 python3 bench/ops_bench.py --ops oproj_ar_norm --cute --cold 8 --blocks 3 \
            --ms ${K3_MS:-1,4,16,64} --shapes tp8,tp2 --out "$R/ops_push.json" ;;
    # the two fused communication ops the issue sets 1.5x targets for, TP=8 shapes, cold weights
    tail) step ops_tail 150 python3 bench/ops_bench.py --ops oproj_ar_norm,latent_tail --cold 8 \
            --ms 1,4,16,64 --shapes tp8 --out "$R/ops_tail.json" ;;
    # the communication kernels' options (early reads, vector signal/poll, w_up prefetch) on two GPUs:
    # their GPU tests with the defaults and with the 45ff89b order, then every option timed in one run
    comm) step comm_tests 300 python3 -m pytest -m gpu -q -rA -s tests/test_gpu.py -k "kernels_match or push"
          step comm_tests_before 300 env K3_KNOBS=comm_vec=0,comm_early=0 python3 -m pytest -m gpu -q -rA -s \
            tests/test_gpu.py -k "kernels_match or push"
          step ops_comm 300 python3 bench/ops_bench.py --ops oproj_ar_norm,latent_tail --comm --cold 8 \
            --ms ${K3_MS:-1,4,16,64} --shapes tp8 --out "$R/ops_comm.json" ;;
    # the same on one GPU with simulated peers (tests/simpeers.py): their GPU test, then every option
    # timed at TP=2 and TP=8 group sizes without NVLink
    commsim) step commsim_tests 300 python3 -m pytest -m gpu -q -rA -s tests/test_gpu.py -k simulated_peers
             step comm_sim 300 python3 bench/comm_sim_bench.py --ms ${K3_MS:-1,4,16,64} --out "$R/comm_sim.json" ;;
    cute) step cute 60 python3 bench/cute_bench.py --out "$R/cute.json"
          step cute_rot 60 python3 bench/cute_bench.py --rotate 8 --out "$R/cute_rot8.json" ;;
    kda8) step "layer_kda_tp8" 300 $LB --layer kda --shapes tp8 --out "$R/layer_kda_tp8.json" ;;
    # one GPU: the layers at TP=8 per-rank widths with no communication (world 1): the compute-side
    # passes and kernels (K3_LB_EXTRA="--ablate-passes lower_decode_gemm" for their rows only)
    # K3_KNOBS gemv_pdl (gemm.gemv_pdl): the GEMV after the one-program norm as a PDL secondary, with its weight
    # rows' first bytes requested into L2 before its wait: the GPU test, the norm + GEMV pair alone, then
    # both layers at M=1: k3 (the default; no PDL before 843c313) beside on (tuning.GEMV_PDL_PF), lz (qkv_a / in_proj
    # forced onto the H100's lazy GEMV configs; the H200 runs them on the MMA GEMM) and lzon (lz with PDL)
    gemvpdl) step pdl_tests 200 python3 -m pytest -m gpu -q -rA tests/test_gpu.py -k "gemv_pdl or two_weights"
         step pdl_probe 200 python3 bench/pdl_probe.py --out "$R/pdl_probe.json"
         for L in mla kda; do
           step layer_${L}_tp8_w1_pdl 300 python3 bench/layer_bench.py --ms ${K3_MS:-1} --ablate 0 --rounds 5 \
             --env on:K3_KNOBS=gemv_pdl=on --env "lz:K3_KNOBS=gemv_cfg=3648x7168=gemvl 4/1024/4/3;6284x7168=gemvl 8/512/4/3" \
             --env "lzon:K3_KNOBS=gemv_pdl=on,K3_KNOBS=gemv_cfg=3648x7168=gemvl 4/1024/4/3;6284x7168=gemvl 8/512/4/3" \
             --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_pdl.json"
         done ;;
    # the layers with the default (K3_KNOBS gemv_pdl on) beside no PDL (off) and PDL without the router + latent's entry
    # (rl0), M = 1..256 (K3_MS)
    pdl1) for L in mla kda; do
            step layer_${L}_tp8_w1_pdl1 300 python3 bench/layer_bench.py --ms ${K3_MS:-1,4,16,64,256} --ablate 0 \
              --env off:K3_KNOBS=gemv_pdl=off --env "rl0:K3_KNOBS=gemv_pdl_pf=3648x7168=16384;6284x7168=16384" \
              --world 1 --layer $L --shapes tp8 --out "$R/layer_${L}_tp8_w1_pdl1.json"
          done ;;
    kda1) step layer_kda_tp8_w1 300 $LB --world 1 --layer kda --shapes tp8 --out "$R/layer_kda_tp8_w1.json" ;;
    mla1) step layer_mla_tp8_w1 300 $LB --world 1 --layer mla --shapes tp8 --out "$R/layer_mla_tp8_w1.json" ;;
    mla8) step layer_mla_tp8 300 $LB --layer mla --shapes tp8 --out "$R/layer_mla_tp8.json" ;;
    kda2) step layer_kda_tp2 120 $LB --layer kda --shapes tp2 --out "$R/layer_kda_tp2.json" ;;
    mla2) step layer_mla_tp2 120 $LB --layer mla --shapes tp2 --out "$R/layer_mla_tp2.json" ;;
    k3c) step k3c_cuda 90 k3c run --device cuda --tp 2 ;;
    *) echo "unknown step $st" | tee -a "$R/summary.txt" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$OUT" r
cat "$R/summary.txt"
