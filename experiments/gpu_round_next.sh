#!/usr/bin/env bash
# The H200 work that the CPU cannot do for the open issues, one device call a part (each under 10 minutes):
#   part 1 (issues 39, 43): 8-bit experts on the GPU: the routed GEMVs' test at the real shapes, then
#          Qwen3-30B-A3B@24 batch-1 decode with bf16 and int8 weights in one process
#   part 2 (issue 39): FP8 W8A8's 8k prefill against bf16 (experiments/with_tables.py FP8_W8A8_ROWS=64), each
#          engine's start printed (the 1k prompt and batch 64 were measured 2026-12-05)
#   part 3 (issue 38): speculation's batched section (random and block-repeating prompts at batch 64)
#   part 4 (issues 43, 39): in-step A/B of the batch-1 MoE configs at Qwen3-30B-A3B@8 (experiments/with_tables.py),
#          then part 2's 32k int8 cache step and FP8 prefill
#   part 5 (issue 39): 8-bit experts' prompt and batched rows: Qwen3-30B-A3B@24 1k prefill and batch 64, bf16 / int8
#   part 6 (issue 39): the 8-bit experts' kernels alone (bench/kernels/moe.py --format int8 / fp8)
#   part 11 (issue 39's bf16 baseline): the bf16 SwiGLU GEMV's block_in as measured (512) against the default it runs
#          at (256: the table's rows are keyed by the fused rows, looked up by the gate rows), Qwen3-4B batch 1, one
#          process each; part 14 the same for Llama-3-8B, and its down at block_in 128 (one wave) against 256
#   part 12 (issue 39): int8 GEMVs at block_in 256 where 512 costs occupancy (Qwen3-4B's down; Llama-3-8B's products,
#          with prmt), against the tables, Qwen3-4B and Llama-3-8B batch 1, one process each
#   part 13 (issue 43): Qwen3-30B-A3B's QKV and o_proj GEMVs at block_in 128 / 512 against the default 256 (which holds
#          ~100 registers there), in-step A/B at @8, one process each
#   part 15 (issue 39): W8A8 in the batched-decode kernel: GPU test, the 64-row sweep, batch 64 on its kept rows
#   part 16 / 19 (issue 39): W8A8 in the Mosaic GPU prompt GEMM (hopper_gemm with x_scale), fp8 (with its GPU test) /
#          int8: the kernel sweep at 1k / 8k rows against XLA's W8A8 and bf16, then Qwen3-4B prefill 1k / 8k on its
#          winning rows, each engine's start printed
#   part 17 / 18 (issue 39): 8-bit experts in W8A8 (grouped_gemm's x_scale, tables.GROUPED_W8A8_ROWS): fp8 (with
#          the GPU test) / int8, Qwen3-30B-A3B@24 1k prefill with W8A8 off and on, one process each
#   part 20 (issue 39): after part 15's rows are in tables.SKINNY_GEMM_8BIT: fp8 batch 64 at 1k with W8A8's row
#          quantization in XLA against its kernel (ROW_QUANTIZE_KERNEL), the first traced (the step's kernels)
#   part 21 (issue 39): Nsight Compute on the int8 decode attention at 32k and the int8 GEMVs, each beside bf16
#   part 22 (issue 39): the int8 decode attention's sweep at 32k with deeper pipelines, then the 32k step on its winner
#   part 23 (issue 39): part 15's batch-64 steps after their out-of-memory on the H100: the step plans' memory first
#   part 24 (issue 39): fp8 W8A8 in XLA with its Triton GEMM fusions off (cuBLASLt only): the 8k engine's start
#   part 25 (issue 39): the defaults since d2ff9f0 (fp8 prompt rows on the Mosaic W8A8 GEMM, int8 GEMVs at one row)
#          on the card at hand for RESULTS' current table: int8 batch 1 (Qwen3-4B, Llama-3-8B), fp8 prefill 1k / 8k
#   part 26 (issue 39): Llama-3-8B's int8 GEMVs swept over rows and block_in, then the step on the sweep's winners
#          (experiments/gemv_table_from_sweep.py) against the tables, one process each
#   part 27 (issue 39): the int8 prompt rows on the Mosaic W8A8 GEMM (defaults since 3585f25) on the card at hand:
#          int8 prefill 1k / 8k against bf16 (measured on an H100 only, 2026-12-06: 1.10x / 1.27x)
#   part 28 (issue 39): part 26 for Qwen3-4B (its 8-bit GEMV rows come from H100 sweeps) on the card at hand
#   part 29 (issue 39): fp8 batch 64 on the defaults since FP8_W8A8_ROWS = 64, then with part 15's skinny W8A8 rows
#   part 30 / 31 (issue 43): the grouped Mosaic GEMM for MoE prompt rows (tables.HOPPER_GROUPED_GEMM): its GPU test,
#          then Mixtral-8x7B@8 / Qwen3-30B-A3B@8 1k prefill, the Triton grouped GEMM against it, one process each
#   part 32 / 33 (issue 43): the grouped GEMMs' config sweep at 1k tokens; the 1k prefill beside transformers
#   part 34 (issue 43): the same sweep at batched-decode rows (32 and 64 tokens)
#   part 35 (issue 39): fp8 batch 64 with all four products on the skinny kernel in W8A8, with and without the row
#          quantization kernel
#   part 36 (issue 39): fp8 batch 64 end to end with the Triton GEMM fusions kept below FP8_W8A8_ROWS, against W8A8 off
#   part 37 / 38 (issue 43): batch 32 / 64 of Qwen3-30B-A3B@24 / Mixtral-8x7B@8 on the grouped Mosaic GEMM from 32
#          tokens (part 34's ranges) against the Triton grouped GEMM below 128 tokens, one process each
#   part 39 (issue 43): both MoE shapes' batch 32 / 64 device step with a different token a row
#   part 40 / 41 (issue 43): tables.GROUPED_GEMM against choose_config's rule, batch 64, Qwen3-30B-A3B@24 / Mixtral
#   part 42 (issue 39): an fp8 lm_head's 2-63 rows on the skinny kernel against XLA's converted values, fp8 batch 64
#   part 43 (issue 43): Qwen3-30B-A3B@24 batch 64 traced
#   part 45 (issue 39): the int8 decode attention at 32k over split counts that fill a wave (any count since the merge
#     pads its tile), then the 32k step on the sweep's winner; part 46 the same for bf16 pages (45 and 48 ran at
#     384223d..be1b34d; the any-count splits lost and were reverted in c841da8: their counts no longer run)
#   part 47 (issue 39): fp8 prefill on the defaults (part 25's second half) since 87f5405 (its engine failed to start)
#   part 48 (issue 39): part 45's 40 and 48 splits at 128 positions with 3-4 stages (its first pass ran them at 2 only)
#   part 50 (issue 43): the expert layouts' searchsorted without its loop, Qwen3-30B-A3B@24 batch 32 / 64 and 1k prefill
#   part 49 (issue 39): part 42 where its rows are sampled: a 1k prompt step of 8 sequences (bench/prefill.py --sequences)
#   part 44 (issue 43): both MoE shapes on the current defaults, batch 1 after 1k (the table) and batch 32 / 64,
#     one model written a shape (the first's removed before the second: the disk holds one MoE shape beside qwen3-4b)
#   part 32 (issue 43): the grouped Mosaic GEMM's configs at 1k tokens (bench/kernels/moe.py), both MoE shapes
#   part 10 (issue 39): int8 W8A8 (tables.INT8_W8A8_ROWS, ops.pallas.int8_w8a8_product): Qwen3-4B 1k / 8k prefill and
#          batch 64 at 1k with int8 weights, the converted values (off) against W8A8 from 64 rows on, one process each
# (8-bit weights at TP > 1: tests/gpu/test_tensor_parallel_gpu.py and experiments/multi_gpu_round.sh 8, several GPUs)
# The machine's disk (64 GB) holds qwen3-4b and one MoE shape, not both MoE shapes: clear the bench models between.
# Usage on the device, from the repo root: bash experiments/gpu_round_next.sh 1|2|...|20
# Carry the Qwen3 tokenizer and stories260k in .carry/ (the GPU tests read .carry/stories260k); llguidance's wheels
# in .carry/wheels for the structured-output tests.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/pylibs PYTHONFAULTHANDLER=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
source experiments/gpu_step.sh
[ -d .carry/wheels ] && pip install -q --no-deps --no-index --target /tmp/pylibs .carry/wheels/*.whl > "$OUT/pip.log" 2>&1
case "${1:-1}" in
  1)   # 8-bit experts: the routed GEMVs' GPU test, then Qwen3-30B-A3B@24 batch 1 bf16 against int8 in one process
    step moe_8bit_test 240 python3 -m pytest -q -o addopts= tests/gpu/test_grouped_gemm_gpu.py -k 8bit
    step moe_int8_decode 330 python3 bench/decode.py --shapes qwen3-30b-a3b@24 --long --paths pallas --quantization int8 \
         --prompt 1024 --new 64 --out "$OUT"
    ;;
  2)   # fp8 W8A8 (tables.FP8_W8A8_ROWS, None by default) at the 8k prompt against bf16, with each row's engine start
       # printed: 2026-12-05's two tries did not see the fp8 8k engine start within 250-300 s (its 1k, int8's 8k and
       # batch 64 were measured then), so this call gives it the whole limit
    step w8a8_prefill_fp8_8k 560 python3 experiments/with_tables.py FP8_W8A8_ROWS=64 -- bench/prefill.py \
         --shapes qwen3-4b --prompts 8192 --paths pallas --quantization fp8 --out "$OUT"
    ;;
  4)   # in-step A/B of batch-1 configs at Qwen3-30B-A3B@8, each variant its own process
    D="bench/decode.py --shapes qwen3-30b-a3b@8 --long --paths pallas --prompt 1024 --new 64 --out $OUT"
    W="python3 experiments/with_tables.py"
    TAIL=3 step moe_v0_default 90 $W -- $D
    TAIL=3 step moe_v1_gateup8 90 $W 'ROUTED_GEMV["swiglu"] = (8, 256)' -- $D
    TAIL=3 step moe_v2_attnrows 90 $W 'GEMV_ROWS[(5120, 2048)] = 4' 'GEMV_ROWS[(2048, 4096)] = 2' -- $D
    TAIL=3 step moe_v3_combine2 90 $W 'ROUTED_GEMV["combine"] = (2, 256)' -- $D
    rm -rf /tmp/jaxinfer-bench-models
    step decode32k 200 python3 bench/decode.py --shapes --long qwen3-4b:32768 --paths pallas --quantization int8 \
         --kv int8 --new 64 --out "$OUT"
    step fp8_prefill 160 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas \
         --quantization fp8 --out "$OUT"
    ;;
  5)   # 8-bit experts' grouped GEMM: Qwen3-30B-A3B@24 1k prefill and batch 64 decode, bf16 against int8
    step moe_int8_prefill 280 python3 bench/prefill.py --shapes qwen3-30b-a3b@24 --prompts 1024 --paths pallas \
         --quantization int8 --out "$OUT"
    step moe_int8_batch64 280 python3 bench/throughput.py --shape qwen3-30b-a3b@24 --ops pallas --batches 64 \
         --context 1024 --steps 32 --decode-only --lazy-compile --quantization int8 --out "$OUT"
    ;;
  6)   # the 8-bit experts' kernels alone: routed GEMV configs at one token, grouped GEMM configs at 64 and 1,024
    TAIL=60 step moe_kernels_int8 280 python3 bench/kernels/moe.py --shapes qwen3-30b-a3b --tokens 1 64 1024 \
         --format int8 --out "$OUT"
    TAIL=60 step moe_kernels_fp8 280 python3 bench/kernels/moe.py --shapes qwen3-30b-a3b --tokens 1 64 1024 \
         --format fp8 --out "$OUT"
    ;;
  10)   # int8 weights' prompt and batched rows: XLA's converted values against INT8 W8A8, each its own process
    for v in off on; do
      R=python3; [ "$v" = on ] && R="python3 experiments/with_tables.py INT8_W8A8_ROWS=64 --"
      step "int8w8a8_prefill_$v" 200 $R bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas \
           --quantization int8 --out "$OUT"
      step "int8w8a8_batch64_$v" 200 $R bench/throughput.py --shape qwen3-4b --ops pallas --batches 64 --context 1024 \
           --steps 32 --decode-only --lazy-compile --quantization int8 --out "$OUT"
    done
    ;;
  11|14)   # the gate/up GEMV at its measured block_in, keyed as block_in_for looks it up (the gate rows); 14: Llama-3-8B,
           # also its down at 128 (at the table's 256 it holds 107 registers: 16 programs an SM, 1.94 waves; 128: 64)
    W="python3 experiments/with_tables.py"
    if [ "$1" = 11 ]; then
      D="bench/decode.py --shapes qwen3-4b --long --paths pallas --prompt 1024 --new 128 --out $OUT"
      TAIL=6 step gateup_block_default 200 $W -- $D
      TAIL=6 step gateup_block_512 200 $W 'GEMV_BLOCK_IN[(9728, 2560)] = 512' -- $D
    else
      D="bench/decode.py --shapes llama3-8b --long --paths pallas --prompt 1024 --new 128 --out $OUT"
      TAIL=6 step llama_default 200 $W -- $D
      TAIL=6 step llama_gateup_512 150 $W 'GEMV_BLOCK_IN[(14336, 4096)] = 512' -- $D
      TAIL=6 step llama_down_128 150 $W 'GEMV_BLOCK_IN[(4096, 14336)] = 128' -- $D
    fi
    ;;
  12)   # int8 GEMVs at block_in 256 where 512 costs occupancy (registers, read offline): Qwen3-4B's down; every
        # Llama-3-8B product (no table rows: 512, one row, cvt), with prmt as at four of Qwen3-4B's five shapes
    D8="bench/decode.py --shapes qwen3-4b llama3-8b --long --paths pallas --prompt 1024 --new 128 --quantization int8 \
--out $OUT"
    W="python3 experiments/with_tables.py"
    L=("GEMV_BLOCK_IN_8BIT[(2560, 9728)] = 256")
    for k in "(6144, 4096)" "(14336, 4096)" "(4096, 4096)" "(4096, 14336)" "(128256, 4096)"; do
      L+=("GEMV_BLOCK_IN_8BIT[$k] = 256" "GEMV_INT8_CONVERT_BY_SHAPE[$k] = 'prmt'")
    done
    TAIL=8 step int8_gemv_default 280 $W -- $D8
    TAIL=8 step int8_gemv_256 280 $W "${L[@]}" -- $D8
    ;;
  13)   # Qwen3-30B-A3B's attention GEMVs (no table rows: block_in 256, one row) where the default costs occupancy
         # (read offline: QKV [5120, 2048] 102 registers, 16 programs an SM, 2.42 waves; o_proj [2048, 4096] 96):
         # in-step A/B at @8, batch 1 after 1k, each variant its own process (as part 4)
    D="bench/decode.py --shapes qwen3-30b-a3b@8 --long --paths pallas --prompt 1024 --new 64 --out $OUT"
    W="python3 experiments/with_tables.py"
    TAIL=3 step moe_attn_default 100 $W -- $D
    TAIL=3 step moe_qkv_128 100 $W 'GEMV_BLOCK_IN[(5120, 2048)] = 128' -- $D
    TAIL=3 step moe_qkv_512 100 $W 'GEMV_BLOCK_IN[(5120, 2048)] = 512' -- $D
    TAIL=3 step moe_oproj_128 100 $W 'GEMV_BLOCK_IN[(2048, 4096)] = 128' -- $D
    ;;
  15)   # W8A8 in the batched-decode kernel (skinny_gemm's x_scale; e4m3 on wgmma through pallas/fp8_dot.py): its GPU
        # test, the 8-bit rows' sweep at 64 rows (converted tiles and W8A8 per config, XLA's two products), then
        # batch 64 at 1k on the sweep's kept rows (bench/throughput.py --skinny-table), one format a process
    TAIL=3 step w8a8_skinny_test 90 python3 -m pytest -q -o addopts= tests/gpu/test_quantized_gemv_gpu.py -k w8a8
    TAIL=14 step w8a8_skinny_sweep 180 python3 bench/kernels/quantized_gemv.py --shapes qwen3-4b --formats int8 fp8 \
         --no-gemv --batched 64 --batched-sweep --budget 110 --out "$OUT"
    for f in fp8 int8; do
      step "w8a8_skinny_batch64_$f" 160 python3 bench/throughput.py --shape qwen3-4b --ops pallas --batches 64 \
           --context 1024 --steps 32 --decode-only --lazy-compile --quantization $f \
           --skinny-table "$OUT/quantized_gemv.json" --out "$OUT"
    done
    ;;
  16|19)   # W8A8 in the Mosaic GPU prompt GEMM, one format a call (16: fp8, with the GPU test first; 19: int8): the
           # kernel's sweep at 1k / 8k rows (JSON in $OUT/FMT/, written after every config), then Qwen3-4B prefill 1k /
           # 8k with its winning rows (bench/prefill.py --hopper-8bit-table) and every other product on the converted
           # values (FP8_W8A8_ROWS / INT8_W8A8_ROWS None: no 8-bit GEMM left for XLA to autotune at start, the
           # suspect of 2026-12-05's fp8 8k engine that never started), each engine's start printed
    f=fp8; [ "$1" = 19 ] && f=int8
    mkdir -p "$OUT/$f"
    # (2026-12-05, H100: the test took 83 s, the prefill step 175 s; the sweep now also compiles the fp8 twin at
    # HIGHEST precision for each product, untimed)
    [ "$1" = 16 ] && TAIL=4 step hopper_w8a8_test 100 python3 -m pytest -q -o addopts= \
         tests/gpu/test_hopper_gemm_gpu.py -k w8a8
    TAIL=12 step "hopper_w8a8_sweep_$f" 230 python3 bench/kernels/hopper_gemm.py --shape qwen3-4b --rows 1024 8192 \
         --w8a8 $f --out "$OUT/$f"
    TAIL=5 step "hopper_w8a8_prefill_$f" 260 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 \
         --paths pallas --quantization $f --hopper-8bit-table "$OUT/$f/kernels_hopper_gemm_w8a8.json" --out "$OUT/$f"
    ;;
  17|18)   # 8-bit experts in W8A8 (17: fp8 with the GPU test first; 18: int8): 1k prefill of Qwen3-30B-A3B@24 with the
           # grouped GEMM's W8A8 off (converted tiles) and on from 64 assignments (GROUPED_W8A8_ROWS), one process each
           # (batched decode's 64 rows are ~4 an expert there: bytes, where W8A8 changes little)
    f=fp8; [ "$1" = 18 ] && f=int8
    [ "$1" = 17 ] && TAIL=4 step grouped_w8a8_test 150 python3 -m pytest -q -o addopts= \
         tests/gpu/test_grouped_gemm_gpu.py -k w8a8
    for v in off on; do
      R=python3; [ "$v" = on ] && R="python3 experiments/with_tables.py GROUPED_W8A8_ROWS=64 --"
      TAIL=4 step "grouped_w8a8_${f}_$v" 210 $R bench/prefill.py --shapes qwen3-30b-a3b@24 --prompts 1024 \
           --paths pallas --quantization $f --out "$OUT"
    done
    ;;
  20)   # W8A8's row quantization kernel, in-step A/B at batch 64 (fp8): its GPU test, then the defaults (XLA's
        # quantization and fp8 GEMMs) traced against the kernel with part 15's skinny W8A8 rows, traced (the norm,
        # the quantization and the gate/up's rows in one kernel: as many kernels a layer as bf16's step)
    TAIL=3 step row_quantize_test 120 python3 -m pytest -q -o addopts= tests/gpu/test_row_quantize_gpu.py
    T="bench/throughput.py --shape qwen3-4b --ops pallas --batches 64 --context 1024 --steps 32 --decode-only \
--lazy-compile --quantization fp8 --out $OUT"
    TAIL=40 step row_quantize_xla 220 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 $T --profile 64
    TAIL=40 step row_quantize_kernel_skinny_rows 220 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 \
         experiments/with_tables.py ROW_QUANTIZE_KERNEL=True -- $T --profile 64 \
         --skinny-table bench/results/2026-12-05-h100-p15-quantized_gemv.json
    ;;
  21)   # Nsight Compute on the int8 kernels whose shares of HBM are unexplained, each beside its bf16 twin: the decode
        # attention at batch 1 and 32k (int8 pages, prmt: ~50% of HBM against bf16's 78%) and the batch-1 GEMVs (int8
        # 41-58% against bf16's 66-84% in the 2026-12-04 trace); one kernel family a run (ncu takes no engine here)
    N="python3 bench/ncu_kernels.py --shape qwen3-4b --batches 1 --skip 1 --count 2 --tokens 4 --out $OUT"
    TAIL=6 step ncu_attention_32k_bf16 70 $N --workload attention-rope --context 32767 --timeout 60
    TAIL=6 step ncu_attention_32k_int8 70 $N --workload attention-rope --context 32767 --timeout 60 --int8-convert prmt
    for w in o-proj gate-up; do
      TAIL=5 step "ncu_${w}_bf16" 55 $N --workload $w --timeout 45
      TAIL=5 step "ncu_${w}_int8" 55 $N --workload $w --timeout 45 --weights int8
    done
    for w in qkv down; do
      TAIL=5 step "ncu_${w}_int8" 55 $N --workload $w --timeout 45 --weights int8
    done
    ;;
  22)   # the int8 decode attention at 32k: its kernel sweep, now with 3-4 pipeline stages around the first pass's top
        # three (a 1-byte stage holds half a bf16 one's bytes; only 32x128 had been tried at 3 stages), then the 32k
        # step with the sweep's winner in the int8 table (bf16 and int8 weights, each against the bf16 cache)
    TAIL=4 step attn_int8_sweep 200 python3 bench/kernels/decode_attention_rope.py --points 1:32768 \
         --kv-cache-dtype int8 --int8-convert prmt --budget 150
    A=$(python3 experiments/attention_table_from_sweep.py "$OUT/decode_attention_rope.json") && \
      TAIL=8 step attn_int8_step32k 300 python3 experiments/with_tables.py "$A" -- bench/decode.py --shapes --long \
           qwen3-4b:32768 --paths pallas --quantization int8 --kv int8 --new 64 --out "$OUT"
    ;;
  23)   # part 15's batch-64 steps again: on the H100 (2026-12-05) both formats' bf16 baselines ran out of memory in
        # their first mixed step (XLA asked for 20.25 GiB: the size of one of the KV pool's two arrays, K or V, of
        # 18,433 pages; 11 GiB left under the 0.75 memory fraction). First the same engine's step plans (XLA's memory
        # analysis: a copy of K or V shows as >= 20 GiB of temporaries), then the A/B at a 0.9 fraction on the
        # H100 sweep's kept rows (committed), one format a process
    TAIL=8 step step_memory_b64 240 python3 experiments/step_memory.py --shape qwen3-4b --max-num-seqs 64 \
         --max-model-len 2304 --out "$OUT"
    for f in fp8 int8; do
      step "w8a8_skinny_batch64_$f" 170 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 bench/throughput.py \
           --shape qwen3-4b --ops pallas --batches 64 --context 1024 --steps 32 --decode-only --lazy-compile \
           --quantization $f --skinny-table bench/results/2026-12-05-h100-p15-quantized_gemv.json --out "$OUT"
    done
    ;;
  24)   # fp8 W8A8 in XLA (FP8_W8A8_ROWS=64) with XLA's Triton GEMM fusions off, so every fp8 GEMM is cuBLASLt's: is
        # the 300 s engine start of 2026-12-05's 8k W8A8 runs XLA autotuning Triton fusions of the fp8 dots (with
        # autotuning off altogether it started but ran at 11 TFLOP/s)? 8k and 1k prompts, each engine start printed
    step w8a8_prefill_fp8_no_triton_gemm 560 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" \
         python3 experiments/with_tables.py FP8_W8A8_ROWS=64 -- bench/prefill.py --shapes qwen3-4b \
         --prompts 8192 1024 --paths pallas --quantization fp8 --out "$OUT"
    ;;
  25)  # the current defaults' figures (run on an H200 where one comes: RESULTS' current 8-bit rows predate them)
    TAIL=8 step int8_decode_defaults 300 python3 bench/decode.py --shapes qwen3-4b llama3-8b --long --paths pallas \
         --quantization int8 --out "$OUT"
    TAIL=6 step fp8_prefill_defaults 280 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas \
         --quantization fp8 --out "$OUT"
    ;;
  26)  # Llama-3-8B's int8 GEMVs: no 8-bit rows in the tables (512 columns, one row, cvt); Qwen3-4B's sweep over rows
       # (2026-12-05, H100) took its step -1.7%
    TAIL=10 step llama_int8_gemv_sweep 200 python3 bench/kernels/quantized_gemv.py --shapes llama3-8b --formats int8 \
         --sweep --sweep-rows 1 2 4 --sweep-block-in 256 512 1024 --sweep-converts cvt prmt --out "$OUT/sweep"
    mapfile -t V < <(python3 experiments/gemv_table_from_sweep.py "$OUT/sweep/quantized_gemv.json" --shape llama3-8b \
                     | grep '^GEMV_')
    printf '# %s\n' "${V[@]}"
    D="bench/decode.py --shapes llama3-8b --long --paths pallas --quantization int8 --out $OUT"
    TAIL=3 step llama_int8_tables 180 python3 experiments/with_tables.py -- $D
    TAIL=3 step llama_int8_swept 180 python3 experiments/with_tables.py "${V[@]}" -- $D
    ;;
  27)  # int8 prefill on the defaults (the Mosaic W8A8 rows since 3585f25), each engine's start printed
    TAIL=6 step int8_prefill_defaults 300 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas \
         --quantization int8 --out "$OUT"
    ;;
  28)  # part 26 for Qwen3-4B on the card at hand: its 8-bit GEMV rows were swept on H100s only; an H200 streams ~1.4x
       # the bytes at the same latency, so it may want more bytes in flight a program (rows, block_in)
    TAIL=10 step qwen_int8_gemv_sweep 200 python3 bench/kernels/quantized_gemv.py --shapes qwen3-4b --formats int8 \
         --sweep --sweep-rows 1 2 4 --sweep-block-in 256 512 1024 --sweep-converts cvt prmt --out "$OUT/sweep"
    mapfile -t V < <(python3 experiments/gemv_table_from_sweep.py "$OUT/sweep/quantized_gemv.json" --shape qwen3-4b \
                     | grep '^GEMV_')
    printf '# %s\n' "${V[@]}"
    D="bench/decode.py --shapes qwen3-4b --long --paths pallas --quantization int8 --out $OUT"
    TAIL=3 step qwen_int8_tables 150 python3 experiments/with_tables.py -- $D
    TAIL=3 step qwen_int8_swept 150 python3 experiments/with_tables.py "${V[@]}" -- $D
    ;;
  29)  # fp8 batch 64 at 1k on the defaults since FP8_W8A8_ROWS = 64 (XLA's fp8 W8A8, no Triton GEMM fusions), against
       # the same with part 15's kept skinny rows (its W8A8 gate/up tiles 23.4 us against XLA's 29.4 at 64 rows), one
       # process each, bf16 in each; the memory fraction of part 23
    T="bench/throughput.py --shape qwen3-4b --ops pallas --batches 64 --context 1024 --steps 32 --decode-only \
       --lazy-compile --quantization fp8 --out $OUT"
    TAIL=6 step fp8_b64_defaults 200 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 $T
    TAIL=6 step fp8_b64_skinny_rows 200 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 $T \
         --skinny-table bench/results/2026-12-05-h100-p15-quantized_gemv.json
    ;;
  30|31)  # the grouped Mosaic GEMM for a mixture of experts' prompt rows (tables.HOPPER_GROUPED_GEMM, the default since
          # 2026-12-06): 30: its GPU test, then Mixtral-8x7B@8 1k prefill on the Triton grouped GEMM (the table
          # emptied) against the default; 31: the same pair at Qwen3-30B-A3B@8. One process each
    if [ "$1" = 30 ]; then
      TAIL=6 step grouped_hopper_gpu_test 300 python3 -m pytest -q -o addopts= tests/gpu/test_grouped_hopper_gemm_gpu.py
      S=mixtral-8x7b@8
    else
      S=qwen3-30b-a3b@8
    fi
    P="bench/prefill.py --shapes $S --prompts 1024 --paths pallas --out $OUT"
    TAIL=3 step "prefill_${S%%@*}_triton_grouped" 180 python3 experiments/with_tables.py "HOPPER_GROUPED_GEMM = {}" -- $P
    TAIL=3 step "prefill_${S%%@*}_mosaic_grouped" 180 python3 $P
    ;;
  32)  # the grouped Mosaic GEMM's configs at 1k tokens, both MoE shapes, beside the Triton grouped GEMM's and XLA's
       # ragged_dot (bench/kernels/moe.py's MOSAIC rows): what parts 30 / 31's table rows should be
    TAIL=40 step moe_grouped_sweep 400 python3 bench/kernels/moe.py --shapes mixtral-8x7b qwen3-30b-a3b --tokens 1024 \
         --out "$OUT"
    ;;
  34)  # the grouped GEMMs at batched-decode rows (32 and 64 tokens: below the Mosaic rows' first assignments), both
       # MoE shapes: whether HOPPER_GROUPED_GEMM's ranges should reach down to batch 32 / 64
    TAIL=60 step moe_grouped_sweep_decode_rows 300 python3 bench/kernels/moe.py --shapes mixtral-8x7b qwen3-30b-a3b \
         --tokens 32 64 --out "$OUT"
    ;;
  35)  # fp8 batch 64 with every product of the step on the skinny kernel in W8A8 (experiments/fp8_skinny_w8a8_all_
       # products.json: each product's best config of part 15's sweep, kept against XLA alone or not), the rows'
       # quantization by the row kernel (norm folded in; traced) and by XLA, one process each, bf16 in each
    T="bench/throughput.py --shape qwen3-4b --ops pallas --batches 64 --context 1024 --steps 32 --decode-only \
--lazy-compile --quantization fp8 --skinny-table experiments/fp8_skinny_w8a8_all_products.json --out $OUT"
    TAIL=40 step fp8_b64_all_skinny_row_kernel 240 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 \
         experiments/with_tables.py ROW_QUANTIZE_KERNEL=True -- $T --profile 64
    TAIL=6 step fp8_b64_all_skinny_xla_rows 200 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 $T
    ;;
  36)  # fp8 batch 64's end-to-end step since the steps below FP8_W8A8_ROWS rows keep XLA's Triton GEMM fusions (the
       # batch's last steps run 2-62 rows: their converted values fused again), against W8A8 off (FP8_W8A8_ROWS =
       # None: every step with the fusions, as before aae24cd); one process each, bf16 in each
    T="bench/throughput.py --shape qwen3-4b --ops pallas --batches 64 --context 1024 --steps 32 --decode-only \
--lazy-compile --quantization fp8 --out $OUT"
    TAIL=6 step fp8_b64_rows_jit 200 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 $T
    TAIL=6 step fp8_b64_w8a8_off 200 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 experiments/with_tables.py \
         FP8_W8A8_ROWS=None -- $T
    ;;
  37|38)  # the grouped Mosaic GEMM at batched-decode rows (HOPPER_GROUPED_GEMM's ranges from 32 tokens since part 34)
          # against the ranges before (from 128 tokens: the Triton grouped GEMM below), batch 64 and 32 at 1k, one
          # process each: 37 Qwen3-30B-A3B@24, 38 Mixtral-8x7B@8
    if [ "$1" = 37 ]; then S=qwen3-30b-a3b@24; LO=1024; else S=mixtral-8x7b@8; LO=256; fi
    T="bench/throughput.py --shape $S --ops pallas --batches 32 64 --context 1024 --steps 32 --decode-only \
--lazy-compile --out $OUT"
    TAIL=8 step "b64_${S%%@*}_triton_below_128" 280 python3 experiments/with_tables.py \
         "HOPPER_GROUPED_GEMM = {k: tuple((max(a, $LO), b, c) for a, b, c in v if b >= $LO) for k, v in HOPPER_GROUPED_GEMM.items()}" -- $T
    TAIL=8 step "b64_${S%%@*}_mosaic_from_32" 280 python3 $T
    ;;
  39)  # both MoE shapes' batch 32 / 64 device step since bench/throughput.py's timed batch gives each row its own
       # token (it gave every row token 7, which routes the rows alike: shares of 145-208% at batch 32), one process each
    for S in qwen3-30b-a3b@24 mixtral-8x7b@8; do
      mkdir -p "$OUT/${S%%@*}"
      TAIL=6 step "moe_b64_distinct_rows_${S%%@*}" 280 python3 bench/throughput.py --shape $S --ops pallas \
           --batches 32 64 --context 1024 --steps 32 --decode-only --lazy-compile --out "$OUT/${S%%@*}"
    done
    ;;
  40|41)  # tables.GROUPED_GEMM (the Triton grouped GEMM's measured configs at 32-127 tokens, no split K) against
          # choose_config's rule (the table emptied), batch 64 at 1k, one process each: 40 Qwen3-30B-A3B@24, 41 Mixtral
    if [ "$1" = 40 ]; then S=qwen3-30b-a3b@24; else S=mixtral-8x7b@8; fi
    T="bench/throughput.py --shape $S --ops pallas --batches 64 --context 1024 --steps 32 --decode-only \
--lazy-compile --out $OUT"
    TAIL=4 step "b64_${S%%@*}_grouped_rule" 180 python3 experiments/with_tables.py "GROUPED_GEMM = {}" -- $T
    TAIL=4 step "b64_${S%%@*}_grouped_table" 180 python3 $T
    ;;
  42)  # an fp8 lm_head's 2-63 sampled rows on the skinny kernel (ops.pallas._fp8_logits_rows) against XLA's converted
       # values (the prompt steps that sample them compile without XLA's GEMM fusions), fp8 batch 64, one process each
    T="bench/throughput.py --shape qwen3-4b --ops pallas --batches 64 --context 1024 --steps 32 --decode-only \
--lazy-compile --quantization fp8 --out $OUT"
    # a patched function is not in the executable cache's key (the tables and the source are): its own HOME, so
    # that the next process neither loads its steps nor it the next one's
    TAIL=6 step fp8_b64_logits_xla 200 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 HOME=$OUT/home_patched python3 \
         experiments/with_tables.py "import jaxinfer.ops.pallas as p; p._fp8_logits_rows = lambda x, w: False" -- $T
    TAIL=6 step fp8_b64_logits_skinny 200 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 $T
    ;;
  43)  # Qwen3-30B-A3B@24 batch 64 at 1k traced (the step's kernels, us a step): where it goes beyond the grouped
       # GEMMs, whose measured configs (tables.GROUPED_GEMM) moved it only 2% where the kernels said 10-16%
    TAIL=60 step moe_b64_traced 280 python3 bench/throughput.py --shape qwen3-30b-a3b@24 --ops pallas --batches 64 \
         --context 1024 --steps 32 --decode-only --lazy-compile --profile 64 --out "$OUT"
    ;;
  44)  # both MoE shapes on the current defaults: batch 1 after 1k (RESULTS' H200 row is from c020908, before the QKV
       # GEMV's 128 columns) and the batch 32 / 64 device steps with a token a row; one model written a shape
    for S in qwen3-30b-a3b@24 mixtral-8x7b@8; do
      mkdir -p "$OUT/${S%%@*}"
      TAIL=4 step "moe_b1_defaults_${S%%@*}" 240 python3 bench/decode.py --shapes $S --long --paths pallas \
           --prompt 1024 --new 64 --out "$OUT/${S%%@*}"
      TAIL=6 step "moe_b32_b64_defaults_${S%%@*}" 200 python3 bench/throughput.py --shape $S --ops pallas \
           --batches 32 64 --context 1024 --steps 32 --decode-only --lazy-compile --out "$OUT/${S%%@*}"
      rm -rf "/tmp/jaxinfer-bench-models/$S"
    done
    ;;
  45)  # batch 1 at 32k: 8 KV heads x 32 splits = 256 programs where the SMs hold 3 (ncu, 2026-12-05: 0.65 waves,
       # 12% achieved occupancy); counts that fill a wave (40-48 at 128 positions, 80-96 at 64), then the step
    TAIL=6 step attn_int8_splits_sweep 240 python3 bench/kernels/decode_attention_rope.py --points 1:32768 \
         --kv-cache-dtype int8 --int8-convert prmt --budget 150 --splits 32 40 48 64 80 96 --block-k 64 128
    A=$(python3 experiments/attention_table_from_sweep.py "$OUT/decode_attention_rope.json") && echo "# $A" && \
      TAIL=8 step attn_int8_splits_step32k 300 python3 experiments/with_tables.py "$A" -- bench/decode.py --shapes \
           --long qwen3-4b:32768 --paths pallas --quantization int8 --kv int8 --new 64 --out "$OUT"
    ;;
  46)  # part 45 for bf16 pages: 64 splits x 8 = 512 programs at 5 an SM (0.78 waves), then the step on the winner
    TAIL=6 step attn_bf16_splits_sweep 240 python3 bench/kernels/decode_attention_rope.py --points 1:32768 \
         --budget 150 --splits 64 80 96 128 --block-k 64 128
    A=$(python3 experiments/attention_table_from_sweep.py "$OUT/decode_attention_rope.json" --table \
        DECODE_ATTENTION) && echo "# $A" && \
      TAIL=8 step attn_bf16_splits_step32k 300 python3 experiments/with_tables.py "$A" -- bench/decode.py --shapes \
           --long qwen3-4b:32768 --paths pallas --new 64 --out "$OUT"
    ;;
  47)  # fp8 prefill on the defaults: part 25's rows failed from a4b28c9 (RowsJit) to 87f5405 (the split prompt step's eval_shape of a
       # step with compiler options; fixed in 87f5405)
    TAIL=6 step fp8_prefill_defaults 280 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas \
         --quantization fp8 --out "$OUT"
    ;;
  48)  # part 45's first pass ran every count at 2 stages, and its second pass deepened only the three best (32 and 64
       # splits): 40 and 48 at 128 positions beside 32, three candidates, so that each gets 3 and 4 stages
    TAIL=6 step attn_int8_splits_s3 120 python3 bench/kernels/decode_attention_rope.py --points 1:32768 \
         --kv-cache-dtype int8 --int8-convert prmt --budget 60 --splits 32 40 48 --block-k 128
    ;;
  49)  # an fp8 lm_head's 2-63 rows on the skinny kernel against XLA's converted values where they are sampled: a prompt
       # step of 1,024 token rows (compiled without XLA's GEMM fusions) ending 8 prompts of 128; one process each
    P="bench/prefill.py --shapes qwen3-4b --prompts 1024 --sequences 8 --paths pallas+fp8 --out $OUT"
    TAIL=3 step fp8_8seq_logits_xla 280 env HOME=$OUT/home_patched python3 experiments/with_tables.py \
         "import jaxinfer.ops.pallas as p; p._fp8_logits_rows = lambda x, w: False" -- $P
    TAIL=3 step fp8_8seq_logits_skinny 280 python3 $P
    ;;
  50)  # the expert layouts without a loop (jnp.searchsorted's compare_all): Qwen3-30B-A3B@24 batch 32 / 64 and 1k prefill,
       # the default method's loop patched back in against the package, one process each, on one machine start
    SCAN="import jax.numpy as jnp; _s = jnp.searchsorted; jnp.searchsorted = lambda *a, method=None, **k: _s(*a, method='scan', **k)"
    S=qwen3-30b-a3b@24
    T="bench/throughput.py --shape $S --ops pallas --batches 32 64 --context 1024 --steps 32 --decode-only --lazy-compile"
    TAIL=4 step moe_b64_scan 170 env HOME=$OUT/home_scan python3 experiments/with_tables.py "$SCAN" -- $T --out $OUT/scan
    TAIL=4 step moe_b64_compare_all 170 python3 $T --out $OUT/compare_all
    P="bench/prefill.py --shapes $S --prompts 1024 --paths pallas"
    TAIL=3 step moe_prefill_scan 100 env HOME=$OUT/home_scan python3 experiments/with_tables.py "$SCAN" -- $P --out $OUT/scan
    TAIL=3 step moe_prefill_compare_all 100 python3 $P --out $OUT/compare_all
    ;;
  33)  # the grouped Mosaic GEMM (the default) beside transformers, one process a shape: 1k prefill
    for S in mixtral-8x7b@8 qwen3-30b-a3b@8; do
      mkdir -p "$OUT/${S%%@*}"
      TAIL=4 step "prefill_${S%%@*}_mosaic_vs_hf" 240 python3 bench/prefill.py --shapes $S --prompts 1024 \
           --paths pallas hf --out "$OUT/${S%%@*}"
    done
    ;;
  3)
    step speculative_batched 330 python3 bench/speculative.py --sections batched --new 128 --out "$OUT"
    ;;
esac
