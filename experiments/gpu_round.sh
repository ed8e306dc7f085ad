#!/usr/bin/env bash
# One device call's worth of GPU work, in priority order; every step prints as it goes and keeps
# its own time limit, so what finishes comes back under $OUT even if a later step is cut off.
#   round 1: GPU correctness, batch-1 decode, prefill (issues 3, 4), then batched decode / offline
#            throughput / prefix cache (issue 5)
#   round profile: prefill's host/launch/device split and traces of batched decode
#   round 2: HTTP serving (issue 6; needs the server wheels carried in .whl, see DEVELOPERS.md)
# Usage on the device: bash bench/gpu_round.sh 1|2   (carry .carry: stories260k/ for the parity test,
# qwen3/ = ../shared/tokenizers/qwen3 for the server; and .whl for round 2)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. PYTHONFAULTHANDLER=1   # a crash prints its Python stack (a segfault once, s24 call 4)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "## $*" | tee -a "$OUT/round.log"; timeout "$limit" "$@" 2>&1 | grep -v -iE 'warning:|warnings\.warn|^W[0-9]{4} ' | tee -a "$OUT/round.log"; }
# The 1k prompt step of each variant in its own process, in the order given: prefill_ab LIMIT VARIANT...
# writes $OUT/prefill_dispatch-N-VARIANT.json (N: its place in the order)
prefill_ab() {
  local limit=$1 i=0; shift
  for v in "$@"; do
    i=$((i + 1))
    step "$limit" python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants "$v" --out "$OUT"
    mv "$OUT/prefill_dispatch.json" "$OUT/prefill_dispatch-$i-$v.json"
  done
}
# For the server: random Qwen3-4B weights with the real tokenizer, and the server's wheels (.whl)
serve_setup() {
  python3 -c "from bench.random_model import bench_model; bench_model('/tmp/jaxinfer-bench-models', 'qwen3-4b')"
  cp .carry/qwen3/tokenizer*.json /tmp/jaxinfer-bench-models/qwen3-4b/
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
}
# Light load through the server (RATE req/s, default 2; 48 prompts of 1,024 + 128 tokens), one server per option
# given ("" for the defaults): servers LIMIT BODY NAME OPTION... writes $OUT/serving-NAME-OPTION.json
servers() {
  local limit=$1 body=$2 name=$3; shift 3
  for v in "$@"; do
    step "$limit" python3 bench/serving.py --serve-model /tmp/jaxinfer-bench-models/qwen3-4b \
         --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64${v:+ --$v}" --request-rates ${RATE:-2} \
         --num-prompts 48 --input-len 1024 --output-len 128 --extra-body "$body" \
         --out "$OUT/serving-$name-${v:-defaults}.json" --client aiohttp
  done
}
case "${1:-1}" in
  skinny)    # the batched-decode GEMM: GPU parity, config sweep and kernel-vs-XLA table, engine check
    step 90 python3 -m pytest -q -o addopts= tests/gpu/test_skinny_gemm_gpu.py
    step 330 python3 bench/kernels/skinny_gemm.py --sweep --budget 180
    step 150 python3 bench/throughput.py --shape qwen3-4b --batches 1 8 32 64 --requests 30 --system 64 --out "$OUT"
    ;;
  batched)   # after the skinny table: prefill host split, TTFT, batched decode and offline throughput
    step 120 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default --out "$OUT"
    step 120 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas --out "$OUT"
    step 320 python3 bench/throughput.py --shape qwen3-4b --requests 300 --profile 64 --out "$OUT"
    ;;
  start)     # cold and warm start of a fresh process (threaded weight loading), then TTFT again
    step 240 python3 bench/warm_start.py --shape qwen3-4b --runs 2 --out "$OUT"
    step 100 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 --paths pallas --out "$OUT"
    ;;
  diag)      # batch-1 decode: weights warm in L2, the server's defaults
    step 120 python3 bench/kernels_l2_prefetch.py
    step 300 python3 bench/decode_dispatch.py --shape qwen3-4b --variants default+greedy logprobs20+greedy \
         len40960+greedy server-defaults+greedy --out "$OUT"
    ;;
  hostprof)  # the server under light and full load with its threads sampled, then its cold and warm start
    [ -n "${NO_L2:-}" ] || step 120 python3 bench/kernels_l2_prefetch.py
    [ -z "${DISPATCH:-}" ] || step 120 python3 bench/decode_dispatch.py --shape qwen3-4b --variants $DISPATCH --out "$OUT"
    if [ -d .whl ] && [ -d .carry/qwen3 ]; then
      serve_setup
      export JAXINFER_HOST_PROFILE="$OUT/host_profile.json"
      step 240 python3 bench/serving.py \
           --serve-model /tmp/jaxinfer-bench-models/qwen3-4b --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64" \
           --request-rates ${RATES:-2,inf} --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving.json"
      unset JAXINFER_HOST_PROFILE
      [ -n "${NO_START:-}" ] || step 240 python3 bench/warm_start.py --serve --shape qwen3-4b --max-num-seqs 256 --runs 2 --out "$OUT"
    fi
    ;;
  fused)     # the decode attention kernel with RoPE and the cache write folded in: parity, then A/B
    step 150 python3 -m pytest -q -o addopts= tests/gpu/test_decode_attention_rope_gpu.py
    step 120 python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py
    step 240 python3 bench/decode.py --shapes qwen3-4b llama3-8b --paths ${PATHS:-pallas pallas-unfused-rope reference} \
         --long qwen3-4b:8192 --out "$OUT"
    [ -n "$NO_TOPK" ] || step 60 python3 bench/kernels/top_k.py --out "$OUT"
    ;;
  final)     # after the nested-jit layers: GPU parity, warm start of the server, serving, batch-1 decode
    step 120 python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py
    if [ -d .whl ] && [ -d .carry/qwen3 ]; then
      serve_setup
      step 150 python3 bench/warm_start.py --serve --shape qwen3-4b --max-num-seqs 256 --runs 2 --out "$OUT"
      step 150 python3 bench/serving.py \
           --serve-model /tmp/jaxinfer-bench-models/qwen3-4b --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64" \
           --request-rates 2,8,inf --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving.json" \
           --plot "$OUT/serving.png"
    fi
    step 90 python3 bench/decode.py --shapes qwen3-4b --paths pallas --long --out "$OUT"
    ;;
  warm)      # round 5: where a warm server start goes (pallas vs reference: Triton kernels
             # reloaded from the persistent cache?), then serving with the fused decode attention,
             # the bucket trimming and the two-stage top-k
    serve_setup
    for ops in ${WARM_OPS:-pallas reference}; do
      step 150 python3 bench/warm_start.py --serve --shape qwen3-4b --ops $ops --max-num-seqs 256 --runs 2 --out "$OUT"
      cp "$OUT/warm_start_serve.json" "$OUT/warm_start_serve_$ops.json"
    done
    step 170 python3 bench/serving.py \
         --serve-model /tmp/jaxinfer-bench-models/qwen3-4b --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64" \
         --request-rates ${RATES:-2,8,inf} --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving.json" \
         --plot "$OUT/serving.png"
    [ -z "${DECODE:-}" ] || step 90 python3 bench/decode.py --shapes qwen3-4b --paths pallas --out "$OUT"
    ;;
  steps)     # round 6's first call: serving with 8, 2, short-at-small-batch and 4 decode steps per
             # dispatch (VARIANTS), after the steps' memory plan; the server's
             # TTFT split (queue / prefill / handoff / parse) printed per rate; the executable cache makes
             # each server's start after the first ~20 s
    serve_setup
    # the server's steps as XLA planned their memory (a KV pool copy would show); fills the executable cache
    step 120 python3 bench/step_memory.py --shape qwen3-4b --max-num-seqs 64 --max-model-len 40960 --out "$OUT"
    # variants: dsN = N decode steps per dispatch; short = 8, but 2 for batches of up to 4 sequences
    for v in ${VARIANTS:-ds8 ds2 short ds4}; do
      case $v in
        short) extra="--decode-steps 8 --short-decode-max-batch 4 --short-decode-steps 2" ;;
        *)     extra="--decode-steps ${v#ds}" ;;
      esac
      step 150 python3 bench/serving.py \
           --serve-model /tmp/jaxinfer-bench-models/qwen3-4b \
           --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64 $extra" \
           --request-rates ${RATES:-2,8,inf} --num-prompts 64 --input-len 1024 --output-len 128 \
           --out "$OUT/serving-$v.json"
    done
    ;;
  gap)       # the server's throughput against offline: offline as before, offline with the engine built as
             # `jaxinfer serve` builds it (tokenizer + detokenizing, top logprobs, prefix caching, 40,960 context),
             # the same with a 1,153-token context, then the server itself all at once
    serve_setup
    M=/tmp/jaxinfer-bench-models/qwen3-4b
    B="--model $M --dtype bfloat16 --ops pallas --input-len 1024 --output-len 128 --batch-size 64 --num-prompts 64"
    step 120 python3 -m jaxinfer.cli bench $B
    step 120 python3 -m jaxinfer.cli bench $B --like-serve --max-model-len 40960
    step 120 python3 -m jaxinfer.cli bench $B --like-serve --max-model-len 1153
    step 120 python3 bench/serving.py --serve-model $M --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64" \
         --request-rates ${RATES:-inf} --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving.json"
    ;;
  gemm)      # the tensor-core GEMM tiled over prompt rows against XLA's (issue 4): GPU tests, sweep at 1k rows,
             # table at 128-8,192 rows; then the decode GEMM's table again (its grid gained an M axis)
    step 120 python3 -m pytest -q -o addopts= tests/gpu/test_skinny_gemm_gpu.py
    step 330 python3 bench/kernels/skinny_gemm.py --prefill --sweep --budget 200
    step 120 python3 bench/kernels/skinny_gemm.py --models qwen3-4b
    ;;
  fp8)       # the float8 KV cache: GPU parity with the reference path, then batched decode with bf16 and with
             # float8 pages (issue 5: B64 <= 1.5 x B1 needs the KV bytes halved), then serving with float8 pages
    step 200 python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py   # all of it: the kernels' casts changed
    step 90 python3 -m pytest -q -o addopts= tests/gpu/test_skinny_gemm_gpu.py -k norm_prologue   # new prologue
    for kv in auto fp8; do
      step 200 python3 bench/throughput.py --shape qwen3-4b --batches 1 8 32 64 128 --requests 100 --system 64 \
           --kv-cache-dtype $kv --out "$OUT"
      cp "$OUT/throughput.json" "$OUT/throughput-$kv.json"
    done
    # batch 1: the KV share of a step grows with context (8k: ~1.2 of ~8.5 GB)
    step 100 python3 bench/decode.py --shapes qwen3-4b --long qwen3-4b:8192 --paths pallas pallas-fp8 --out "$OUT"
    ;;
  regress)   # round 7: batched decode came back slower (B8 3.52 -> 5.32 ms) after the GEMM's row tiles
             # and norm prologue; the prologue against XLA's norm per kernel, traces of B8 and B64, and the
             # same at the commit before the prologue (PRE=.ab/pre_norm: that commit's jaxinfer/, carried)
    step 150 python3 bench/kernels/skinny_gemm.py --norm --models qwen3-4b
    step 150 python3 bench/throughput.py --shape qwen3-4b --batches 8 64 --requests 30 --system 64 --profile 8 64 --out "$OUT"
    mkdir -p "$OUT/pre"; [ -z "${PRE:-}" ] || PYTHONPATH=$PRE:. step 120 python3 bench/throughput.py --shape qwen3-4b --batches 8 64 \
         --requests 30 --system 64 --out "$OUT/pre"
    ;;
  fp8b)      # after the prologue's revert: float8 decode attention swept (its first table doubles bf16's block_k),
             # then batched decode with bf16 and with float8 pages (issue 5: B64 <= 1.5 x B1)
    step 200 python3 bench/kernels/decode_attention.py --kv-cache-dtype fp8 --sweep --no-table --budget ${SWEEP_S:-140} \
         --points 64:1024 16:1024 1:8192 128:1024 1:1024 4:8192 64:8192
    for kv in auto fp8; do
      step 160 python3 bench/throughput.py --shape qwen3-4b --batches 1 8 32 64 128 --requests 100 --system 64 \
           --kv-cache-dtype $kv --out "$OUT"
      cp "$OUT/throughput.json" "$OUT/throughput-$kv.json"
    done
    ;;
  fp8c)      # float8 decode attention with float16 queries (e4m3 -> f16 is one instruction; -> bf16 is not),
             # then the server traced (the trace round)
    for qd in bfloat16 float16; do
      step 90 python3 bench/kernels/decode_attention.py --kv-cache-dtype fp8 --query-dtype $qd --sweep --no-table \
           --budget 45 --points 64:1024 128:1024 1:8192
      cp "$OUT/decode_attention.json" "$OUT/decode_attention-fp8-$qd.json"
    done
    bash bench/gpu_round.sh trace
    ;;
  fp8d)      # float8 pages multiplied in float16: GPU parity with a float8 cache, batched decode with float8 pages,
             # then (time allowed) the prefill GEMM's default config against XLA's
    step 120 python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py -k float8
    step 130 python3 bench/throughput.py --shape qwen3-4b --batches 1 8 32 64 128 --requests 100 --system 64 \
         --kv-cache-dtype fp8 --out "$OUT"
    step ${GEMM_S:-100} python3 bench/kernels/skinny_gemm.py --prefill --models qwen3-4b
    ;;
  gaps)      # round 8's first call: GPU parity (the greedy-only prompt step is on by default on GPUs,
             # not yet run there); where the server's device idles under load (a third of the time in run 4 of
             # the seventh, in 15-18 ms gaps): the engine thread's phases and Python's collections printed per
             # rate beside a device trace (traces kept as a tarball: the device tool drops deep folders); then
             # the server with prompt steps read back one step late (--overlap-mixed)
    step 150 python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py
    serve_setup
    M=/tmp/jaxinfer-bench-models/qwen3-4b
    step 200 python3 bench/serving.py --serve-model $M --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64" \
         --request-rates ${RATES:-2,inf} --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving-gaps.json" \
         --device-trace /tmp/traces --device-trace-seconds ${TRACE_S:-1} --client aiohttp
    tar czf "$OUT/traces.tgz" -C /tmp traces 2>/dev/null
    step 130 python3 bench/serving.py --serve-model $M \
         --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64 --overlap-mixed" --request-rates 2,inf \
         --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving-overlap.json" --client aiohttp
    ;;
  gaps3)     # after run 1 of round 8 (the default server died with CUDA_ERROR_LAUNCH_FAILED in
             # jit_mixed_step 0.7 s into a device trace): the rest of GPU parity, the default server untraced at
             # 2 req/s and all at once (the side-by-side for --overlap-mixed), then offline like the server
             # without and with --overlap-mixed
    step 260 python3 -m pytest -q -p no:warnings -o addopts= tests/gpu/test_parity_gpu.py -k "float8 or late"
    serve_setup
    M=/tmp/jaxinfer-bench-models/qwen3-4b
    step 150 python3 bench/serving.py --serve-model $M --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64" \
         --request-rates 2,inf --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving-default.json" \
         --client aiohttp
    B="--model $M --dtype bfloat16 --ops pallas --input-len 1024 --output-len 128 --batch-size 64 --num-prompts 64"
    step 90 python3 -m jaxinfer.cli bench $B --like-serve
    step 90 python3 -m jaxinfer.cli bench $B --like-serve --overlap-mixed
    ;;
  margin)    # the float8 parity failure of run 2 (qwen3: tokens part at 109 of 128): how close the call was there,
             # and whether the greedy-only prompt step changed it; then the server with and without
             # --overlap-mixed side by side (light-load TTFT, all-at-once throughput)
    step 240 python3 bench/parity_margin.py --models qwen3 --kv auto fp8 --greedy-kv fp8
    serve_setup
    M=/tmp/jaxinfer-bench-models/qwen3-4b
    for v in default overlap; do
      extra=""; [ $v = overlap ] && extra="--overlap-mixed"
      step 140 python3 bench/serving.py --serve-model $M --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64 $extra" \
           --request-rates 2,inf --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving-$v.json" \
           --client aiohttp
    done
    ;;
  parity2)   # after overlap_mixed became a GPU default: the whole GPU parity file (float32 tests now read prompt
             # steps back late; the float8 test accepts partings at near ties), then the prefill GEMM's sweep
             # at 1k rows against XLA's (issue 4)
    step 330 python3 -m pytest -q -p no:warnings -o addopts= tests/gpu/test_parity_gpu.py
    step 200 python3 bench/kernels/skinny_gemm.py --prefill --sweep --budget ${SWEEP_S:-110} --models qwen3-4b
    ;;
  ttft)      # round 9's first call: GPU parity (a newcomer's prompt step now goes behind the decode
             # dispatch in flight, with overlap_mixed, the GPU default), then the server with it and without it
             # (--no-prefill-behind-decode) side by side at 2 and 8 req/s (the light-load TTFT target is 25 ms)
    step 330 python3 -m pytest -q -p no:warnings -o addopts= tests/gpu/test_parity_gpu.py
    serve_setup
    M=/tmp/jaxinfer-bench-models/qwen3-4b
    for v in prefill-behind-decode no-prefill-behind-decode; do
      step 120 python3 bench/serving.py --serve-model $M --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64 --$v" \
           --request-rates ${RATES:-2,8} --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving-$v.json" \
           --client aiohttp
    done
    ;;
  tenth)     # round 10's first call: the fresh prompt's and the prefixed chunk's bf16 parity against float32
             # (not yet passed on a GPU; if the fresh one fails, fresh_prompt_attention goes back off by default), the
             # one-sequence ops' GPU tests and
             # kernel times (the prefixed-chunk op is new: cuDNN's log-sum-exp convention is checked there), then
             # prefill up to 32k with and without the fresh op, and with the prefixed-chunk op at 32k
    step 190 python3 -m pytest -q -s -p no:warnings -o addopts= tests/gpu/test_parity_gpu.py -k on_cudnn_attention
    step 90 python3 -m pytest -q -p no:warnings -o addopts= tests/gpu/test_fresh_prompt_attention_gpu.py
    step 100 python3 bench/kernels/prefill_attention.py --fused
    step 130 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 32768 --paths pallas pallas-paged --out "$OUT"
    mkdir -p "$OUT/prefixed"
    step 90 python3 bench/prefill.py --shapes qwen3-4b --prompts 32768 --paths pallas-prefixed --out "$OUT/prefixed"
    ;;
  parity)    # round 10's second call: the cuDNN paths' bf16 parity again (the test now compares the first
             # token's top-20 logprobs: run 1's fresh case parted from float32 at token 0, a near tie where all
             # three bf16 paths parted), the prefixed op's crossover in prefix length (chunks of 1,024 and 2,048
             # after 1,024-2,048 tokens: its prefix is gathered at the page row's whole span), then round sampled
    step 190 python3 -m pytest -q -s -p no:warnings -o addopts= tests/gpu/test_parity_gpu.py -k on_cudnn_attention
    step 120 python3 bench/kernels/prefill_attention.py --fused
    bash "$0" sampled
    ;;
  eleventh)  # round 11's first call: the whole GPU parity file (10 tests; plain_sampling_step and the top-k
             # sampler are new defaults: its last test compares them with the branching sampler)
    step 560 python3 -m pytest -q -p no:warnings -o addopts= tests/gpu/test_parity_gpu.py
    ;;
  host)      # round 13's first call (the twelfth's last ran an earlier form: run 5): the kernel that now
             # also returns the k/v it writes and the fresh op on them (GPU tests); a 1k prefill's host / launch / device
             # split and prefill.py at 1k and 8k (the skipped sampler-row reset, no gather back; predicted 1k TTFT
             # 16.67 -> ~16.1 ms); the prompt step's host time on the GPU host with the server's shapes, with
             # prefill.py's, and with a penalty (the reset that requests without one now skip)
    step 90 python3 -m pytest -q -o addopts= tests/gpu/test_rope_kv_write_gpu.py tests/gpu/test_fresh_prompt_attention_gpu.py
    step 120 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default --out "$OUT"
    step 100 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas --out "$OUT"
    step 120 python3 bench/host_prompt_step.py
    step 60 python3 bench/host_prompt_step.py --max-num-seqs 1 --max-model-len 1040
    step 60 python3 bench/host_prompt_step.py --max-num-seqs 1 --max-model-len 1040 --repetition-penalty 1.1
    ;;
  lmhead)    # round 13's fourth call: the batch-1 lm_head on the fused GEMV with float32 outputs (GPU
             # test at real vocabularies; decode at the three shapes: predicted Qwen3-4B 2.616 -> ~2.59 ms, XLA's
             # reduce fusions 207 us a step against a ~178 us GEMV); the 1k prefill's idle time between kernels
             # (traced: which kernels it follows) and whether XLA flags on command buffers take it
    step 60 python3 -m pytest -q -o addopts= tests/gpu/test_gemv_gpu.py -k lm_head
    step 230 python3 bench/decode.py --shapes qwen3-4b llama3-8b qwen3-0.6b --paths pallas --out "$OUT"
    step 250 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 \
         --variants default profiled-with-cmdbuf update-skip-temp cmdbuf-every-type graph-min-1 --out "$OUT"
    ;;
  stacked)   # round 13's fifth call: greedy parity in float32 and with float8 pages (the lm_head GEMV
             # is on every Pallas step now); a jitted call's host time by its number of arrays; the 1k prefill with
             # the layers unrolled over stacked weights (a dozen arrays, not ~300), with and without XLA's dynamic
             # slice fusion (predicted: launch 1.15 -> ~0.4 ms if the arrays are the cost; the raw step grows by
             # the weight copies unless the fusion takes them)
    JAXINFER_PRINT_FAILURES=1 step 170 python3 -m pytest -q -p no:warnings -o addopts= tests/gpu/test_parity_gpu.py \
         -k "float32 or float8"
    step 40 python3 bench/dispatch_args.py --out "$OUT"
    step 200 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 \
         --variants default stacked-weights stacked-weights-dsf --out "$OUT"
    ;;
  vectors)   # round 13's last call (~4 min of budget): split_layers keeps the vectors stacked (the step
             # takes 148 arrays, not 292: predicted launch -0.3 ms, 1k TTFT 15.9-16.8 -> ~15.6); decode unchanged
    step 110 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default --out "$OUT"
    step 80 python3 bench/decode.py --shapes qwen3-4b --paths pallas --out "$OUT"
    ;;
  autotune0) # the gate/up GEMM's 4-byte memset (cuBLAS's own, ~5 us idle a layer) with cuBLAS's heuristic algorithms
    step 170 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants profiled-autotune-0 --out "$OUT"
    ;;
  pairs)     # round 17's first call: three changes of the sixteenth, each against the package before
             # it, in one run, each its own process: the kernels' layer indices as one-entry operands (blocks.
             # layer_operands; before, each [layer, vector_layer] pair was a parameterless XLA fusion run every step:
             # 37 of them, ~0.84 us each, in a batch-1 Qwen3-4B step), the merge kernel reading only the splits that
             # had positions, the greedy step's argmax and logprob in two reductions (sampling.greedy_with_logprob).
             # .carry/before-X = `git archive REV jaxinfer` (DEVELOPERS.md). Predictions in NOTES: batch 1 2.56 ->
             # ~2.53 ms (pairs), ~-0.02 ms (merge), ~-0.01 ms (logprob); Qwen3-0.6B 0.875 -> ~0.84 in all; the same
             # greedy tokens throughout
    for pkg in before-pairs before-merge before-logprob now; do
      path=.; [ $pkg != now ] && path=.carry/$pkg:.
      step 110 env PYTHONPATH=$path python3 bench/decode_dispatch.py --shape qwen3-4b --variants default+greedy \
           --out "$OUT"
      mv "$OUT/decode_dispatch.json" "$OUT/decode_dispatch-qwen3-4b-$pkg.json"
    done
    for pkg in before-pairs now; do
      path=.; [ $pkg != now ] && path=.carry/$pkg:.
      step 80 env PYTHONPATH=$path python3 bench/decode_dispatch.py --shape qwen3-0.6b --variants default+greedy \
           --out "$OUT"
      mv "$OUT/decode_dispatch.json" "$OUT/decode_dispatch-qwen3-0.6b-$pkg.json"
    done
    ;;
  pairs8)    # batch 8, the package before the three changes against now (its step had 36 pair fusions, 0.81 us each;
             # the merge reads every split at batch 8 and 1k either way; the greedy logprob applies); ~160 s an engine
    step 280 env PYTHONPATH=.carry/before-pairs:. python3 bench/throughput.py --shape qwen3-4b --batches 8 \
         --decode-only --out "$OUT"
    mv "$OUT/throughput.json" "$OUT/throughput-b8-before.json"
    step 280 python3 bench/throughput.py --shape qwen3-4b --batches 8 --decode-only --out "$OUT"
    mv "$OUT/throughput.json" "$OUT/throughput-b8-after.json"
    ;;
  normflags) # (does not run as written: the flag is not one of jax 0.11.2's XLA, and the variants are gone; seventeenth
             # round, run 3) XLA's residual add (or split-K finish) and the RMSNorm fusion after it run as two kernels (the norm is a
             # Triton softmax-style fusion the add does not join): 72 pairs a 1k prefill step (5.5 + 4.5 us), two a
             # layer at batch 8 (1.7 + 2.4 us). Without Triton's norm fusions the add might join a native norm
             # reduction. The 1k prefill first (one process a variant), then batch 8 (an engine each, ~160 s)
    step 200 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default no-triton-norm \
         profiled-no-triton-norm --out "$OUT"
    step 250 env XLA_FLAGS="${FLAGS:---xla_gpu_enable_triton_softmax_fusion=false}" python3 bench/throughput.py \
         --shape qwen3-4b --batches 8 --decode-only --out "$OUT"
    mv "$OUT/throughput.json" "$OUT/throughput-b8-flags.json"
    ;;
  barrier)   # does a grid barrier order memory between Pallas Triton programs? (the persistent MLP block's outputs
             # were off at 256-512 programs): wrong values and the counter, by variant (fences, the last arriver)
             # and program count; ~1 min. What a persistent kernel or a merge by the last split needs first
    step 150 python3 bench/kernels/barrier.py --programs 128 256 512 1024 --calls 200
    ;;
  skinny32)  # batch 17-32's projections: the tensor-core GEMM's table has M = 16 and 64 configs only, and B32's step runs
             # gate/up on XLA's GEMM at 32.7 us a layer (the M = 64 sweep found XLA faster there); a sweep at M = 32
    step 330 python3 bench/kernels/skinny_gemm.py --sweep --sweep-ms 32 --ms 32 --models qwen3-4b --budget 260
    ;;
  table16)   # after batch 5-8's attention row (8 x 64): the batched decode table at batch 1-64 with the tables as
             # shipped, and Llama-3-8B's batch-1 decode with its QKV at 2 rows a program
    step 330 python3 bench/throughput.py --shape qwen3-4b --batches 1 8 32 64 --decode-only --out "$OUT"
    step 200 python3 bench/decode.py --shapes llama3-8b --paths pallas --out "$OUT"
    ;;
  ropeattn)  # the engine's decode attention kernel (RoPE, norm, cache write fused) by split config at batch 1-32
             # (bench/kernels/decode_attention.py sweeps the plain kernel, which the step no longer runs); batch 8's
             # attention took 17.6 us a layer in round 13's trace against ~7.5 at the read ceiling
    step 420 python3 bench/kernels/decode_attention_rope.py --budget 330
    ;;
  swiglu)    # (the interleaved variant was removed in round 17: this round no longer runs as written) the SwiGLU GEMV on interleaved gate/up rows (gate i at 2i, up i at
             # 2i + 1) against the fused matrix's split rows (26.0 us against the plain GEMV's 23.7), alone and in the
             # batch-1 step (same greedy tokens expected)
    step 150 python3 bench/kernels/fused_gemv.py --shape qwen3-4b --rows 1 2 --out "$OUT"
    step 150 python3 bench/decode_dispatch.py --shape qwen3-4b --variants default+greedy interleaved+greedy --out "$OUT"
    mv "$OUT/fused_gemv.json" "$OUT/fused_gemv-swiglu.json"
    # (pallas/mlp_block.py and --mlp-block were removed in round 17; at dae4e19)
    # the persistent MLP block (pallas/mlp_block.py: one kernel, a grid barrier between SwiGLU and down) against
    # the engine's two kernels; last, and under its own limit: a program count the GPU cannot keep resident
    # would spin forever (prediction in NOTES: 36-42 us against 39.5)
    step 120 python3 bench/kernels/fused_gemv.py --shape qwen3-4b --mlp-block 256 512 1024 --out "$OUT"
    ;;
  b8redo)    # batch 8's attention row A/B again, each row compiled (round 14's second run loaded the
             # first run's executables: void); each engine start compiles ~125 s
    step 280 python3 bench/throughput.py --shape qwen3-4b --batches 8 --decode-only --attention-config 8/64 --out "$OUT"
    mv "$OUT/throughput.json" "$OUT/throughput-b8-8x64.json"
    step 280 python3 bench/throughput.py --shape qwen3-4b --batches 8 --decode-only --attention-config 4/64 --out "$OUT"
    mv "$OUT/throughput.json" "$OUT/throughput-b8-4x64.json"
    ;;
  rows3)     # Llama-3-8B's QKV at 2 rows a program in its batch-1 step (the kernel alone: 15.73 -> 14.81 us); then
             # Qwen3-4B's batch-1 step with decode attention forced to 16 and to 64 splits of 64 (the table's 64 at a
             # 1k context leaves 48 programs empty and the merge reads all 64)
    step 240 python3 bench/decode_dispatch.py --shape llama3-8b --variants default+greedy llama-qkv-rows2+greedy \
         --out "$OUT"
    mv "$OUT/decode_dispatch.json" "$OUT/decode_dispatch-llama.json"
    step 200 python3 bench/decode_dispatch.py --shape qwen3-4b --variants attn-64x64+greedy attn-16x64+greedy \
         --out "$OUT"
    ;;
  rows)      # the decode GEMVs by output rows per program: in isolation (each projection over 36 stacked layers,
             # against the no-prologue kernel and the plain GEMV), then the batch-1 step at 1 / 2 / 4 rows
    step 200 python3 bench/kernels/fused_gemv.py --shape qwen3-4b --out "$OUT"
    step 280 python3 bench/decode_dispatch.py --shape qwen3-4b --variants default+greedy ${ROWS_VARIANTS:-rows2+greedy \
         rows4+greedy} --out "$OUT"
    ;;
  rows2)     # after Qwen3-4B's QKV took 2 rows a program (fused_gemv.ROWS): the other shapes' projections by rows,
             # the batch-1 decode table for Qwen3-4B, greedy parity in float32
    step 150 python3 bench/kernels/fused_gemv.py --shape llama3-8b --rows 1 2 4 --repeats 3 --out "$OUT"
    mv "$OUT/fused_gemv.json" "$OUT/fused_gemv-llama3-8b.json"
    step 100 python3 bench/kernels/fused_gemv.py --shape qwen3-0.6b --rows 1 2 4 --repeats 3 --out "$OUT"
    mv "$OUT/fused_gemv.json" "$OUT/fused_gemv-qwen3-0.6b.json"
    step 120 python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py -k float32
    step 120 python3 bench/decode.py --shapes qwen3-4b --paths pallas --out "$OUT"
    ;;
  pdl)       # programmatic dependent launch (jaxlib 0.11.2's --xla_gpu_enable_pdl / _launch, off by default): batch-1
             # decode and the 1k prompt step, each variant its own process, greedy outputs fingerprinted; then
             # greedy parity (Pallas = reference, float32) with both flags on; then a decode trace with them
    step 240 python3 bench/decode_dispatch.py --shape qwen3-4b --variants default+greedy pdl+greedy \
         pdl-launch+greedy --out "$OUT"
    step 150 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default pdl pdl-launch \
         --out "$OUT"
    step 180 env XLA_FLAGS="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" \
         python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py -k float32
    mv "$OUT/decode_dispatch.json" "$OUT/decode_dispatch-pdl.json"
    step 100 python3 bench/decode_dispatch.py --shape qwen3-4b --variants profiled-pdl-launch+greedy --out "$OUT"
    ;;
  pdl1)      # the decode GEMVs' weight tiles loaded before griddepcontrol.wait (fused_gemv's `prefetch`; twenty-sixth
             # round): the chain test under default and PDL flags, then batch-1 decode, each variant its own process.
             # Measured nothing (bench/NOTES.md) and removed after; kept as the record of calls 1-5: needs f5b6e27's
             # package (0a74942 for the no-cmdbuf variants) to mean anything
    step 150 python3 -m pytest -q -o addopts= tests/gpu/test_gemv_gpu.py -k grid_dependency
    step 150 env XLA_FLAGS="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" \
         python3 -m pytest -q -o addopts= tests/gpu/test_gemv_gpu.py -k grid_dependency
    step 420 python3 bench/decode_dispatch.py --shape qwen3-4b --variants default+greedy pdl-launch+prefetch4 \
         pdl-launch+greedy pdl+prefetch4 pdl-launch+prefetch8 default+prefetch4 --out "$OUT"
    ;;
  pdlmosaic) # does XLA launch a Mosaic GPU kernel that uses griddepcontrol (its module marked uses_pdl) programmatically,
             # and what would a Mosaic GEMV overlap? chains of tiny kernels and of weight-streaming kernels at Qwen3-4B's
             # batch-1 layer sizes, with / without the calls, without and with --xla_gpu_enable_pdl (round 26)
    step 150 python3 bench/pdl_mosaic_probe.py
    step 150 env XLA_FLAGS="--xla_gpu_enable_pdl=true" python3 bench/pdl_mosaic_probe.py
    step 150 env XLA_FLAGS="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" python3 bench/pdl_mosaic_probe.py
    ;;
  persistent) # fewer kernel boundaries: the batch-1 layer's weights streamed by one kernel a layer / one for 8 layers,
             # without and with a grid barrier (a global semaphore) at each phase start (round 27)
    step 300 python3 bench/pdl_mosaic_probe.py --mode persistent --only-barrier-count
    ;;
  persist1)  # the persistent GEMV chain (pallas/persistent_gemv.py, round 28; an experiment, not in the ops):
             # its GPU tests, then Qwen3-4B-shaped layers in one launch (grid barriers, static or ticketed tiles)
             # against the engine's fused_gemv chain
    step 240 python3 -m pytest -q -o addopts= tests/gpu/test_persistent_gemv_gpu.py
    step 330 python3 bench/kernels/persistent_gemv.py --shapes qwen3-4b --out "$OUT"
    ;;
  persist1b) # after persist1 (call 1: the loop streamed at 66% without meetings): prefetch depth, CTAs an SM, a phase's
             # first weights loaded before its barrier; both shapes in one call
    step 560 python3 bench/kernels/persistent_gemv.py --shapes qwen3-4b qwen3-0.6b --out "$OUT"
    ;;
  persist1c) # after persist1b (deeper prefetch lost: registers): the input reloaded every tile (L1) so the registers go
             # to weights in flight; more warps an SM
    step 560 python3 bench/kernels/persistent_gemv.py --shapes qwen3-4b qwen3-0.6b --out "$OUT"
    ;;
  jt1)       # official Triton through jax_triton (its wheel carried in .carry/jt): does it run on jax 0.11.2, and does a
             # persistent GEMV with a pipelined tile loop (tl.range num_stages) stream better than Pallas Triton's, and
             # the four-product chain as one such kernel; then the Pallas persistent chain with its tile loop handed to
             # the pipeliner (num_stages 3-4); last the persistent_gemv GPU tests at calls 2-3's options
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/jt/*.whl
    step 260 env PYTHONPATH=.:/tmp/site python3 bench/jax_triton_probe.py
    step 170 python3 bench/kernels/persistent_gemv.py --shapes qwen3-4b qwen3-0.6b --out "$OUT"
    step 100 python3 -m pytest -q -o addopts= tests/gpu/test_persistent_gemv_gpu.py
    ;;
  jt2)       # jt1's probe again with the TMA_TF32 shim (jax_triton 0.4.1 against triton 3.6.0), alone
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/jt/*.whl
    step 150 env PYTHONPATH=.:/tmp/site python3 bench/jax_triton_probe.py
    ;;
  issue3a)   # issue 3's table for Qwen3-4B in one run (1,024 and 8,192 tokens of context): Pallas, the XLA reference,
             # transformers eager and transformers with a static cache under torch.compile (bench/hf_peer.py, never run on
             # the GPU before), the Pallas step traced (kernels per step and their times); decode.json after every case
    step 570 python3 bench/decode.py --shapes qwen3-4b --long qwen3-4b:8192 --paths pallas reference hf hf-compile \
         --profile pallas --out "$OUT"
    ;;
  issue3b)   # the same for Qwen3-0.6B and Llama-3-8B at 1,024 tokens (both Pallas steps traced)
    step 570 python3 bench/decode.py --shapes qwen3-0.6b llama3-8b --long --paths pallas reference hf hf-compile \
         --profile pallas --out "$OUT"
    ;;
  prefix29)  # issue 5's cached-prefix gain again (last measured in round 2, 4.4x, before the prompt kernels
             # changed): TTFT of a 2,048-token system prompt + 8 tokens, cold against cached, batch 1's step beside it
    step 400 python3 bench/throughput.py --shape qwen3-4b --batches 1 --requests 10 --system 2048 --lazy-compile \
         --out "$OUT"
    ;;
  mosaicgemv) # the Mosaic GPU decode GEMV (pallas/mosaic_gemv.py, round 26; an experiment, not in the ops):
             # its GPU tests, then a chain of Qwen3-4B-shaped layers against the engine's Triton GEMV, without and with
             # --xla_gpu_enable_pdl (its griddepcontrol variant waits for the kernel before after its first weight tiles)
    step 200 python3 -m pytest -q -o addopts= tests/gpu/test_mosaic_gemv_gpu.py
    step 150 python3 bench/kernels/mosaic_gemv.py --out "$OUT"
    mv "$OUT/kernels_mosaic_gemv.json" "$OUT/kernels_mosaic_gemv-noflag.json"
    step 150 env XLA_FLAGS="--xla_gpu_enable_pdl=true" python3 bench/kernels/mosaic_gemv.py --out "$OUT"
    ;;
  norm8)     # batch 8's QKV and gate/up GEMMs with the RMSNorm as their prologue, folded and exactly rounded (run 4 of
             # round 17, at 495a3e6; reverted after it: 3.17 -> 5.16 / 4.89 ms, as in the seventh
             # round). Kept as the record of that run; needs 495a3e6's package in .carry/norm8 to mean anything
    step 200 env PYTHONPATH=.carry/before-norm:. python3 bench/throughput.py --shape qwen3-4b --batches 8 \
         --decode-only --out "$OUT"
    mv "$OUT/throughput.json" "$OUT/throughput-b8-before.json"
    step 200 env PYTHONPATH=.carry/norm8:. python3 bench/throughput.py --shape qwen3-4b --batches 8 --decode-only \
         --out "$OUT"
    mv "$OUT/throughput.json" "$OUT/throughput-b8-folded.json"
    ;;
  skinny32ab) # batch 17-32's GEMMs at their own M = 32 configs: the sweep at M = 32 (its winners: the configs that beat
             # XLA at M = 32 in the same run), then batch 32 decode without and with them in the table
             # (throughput.py --skinny-table), engines compiled lazily (only the steps taken). B32's gate/up runs on
             # XLA's GEMM (32.7 us a layer, round 16). Predicted in NOTES: 4.45 -> ~4.25 ms if gate/up wins
    step 250 python3 bench/kernels/skinny_gemm.py --sweep --sweep-ms 32 --ms 32 --models qwen3-4b --budget 150
    step 150 python3 bench/throughput.py --shape qwen3-4b --batches 32 --decode-only --lazy-compile --out "$OUT"
    mv "$OUT/throughput.json" "$OUT/throughput-b32-before.json"
    step 150 python3 bench/throughput.py --shape qwen3-4b --batches 32 --decode-only --lazy-compile \
         --skinny-table "$OUT/skinny_gemm.json" --out "$OUT"
    mv "$OUT/throughput.json" "$OUT/throughput-b32-table.json"
    ;;
  skinny32b) # run 5's M = 32 rows that keep the summation order (QKV: split 1 as before; down: split 4 as before,
             # other stages) against none, batch 32; then batch 8 in an engine compiled at start against a lazy one
             # (run 5's lazy B32 engine measured 4.342 ms where round 16's eager ones measured 4.45-4.49)
    for t in none qkv-down; do
      extra=(); [ $t != none ] && extra=(--skinny-table .carry/skinny32-$t.json)
      step 150 python3 bench/throughput.py --shape qwen3-4b --batches 32 --decode-only --lazy-compile "${extra[@]}" \
           --out "$OUT"
      mv "$OUT/throughput.json" "$OUT/throughput-b32-$t.json"
    done
    for how in eager lazy; do
      extra=(); [ $how = lazy ] && extra=(--lazy-compile)
      step 200 python3 bench/throughput.py --shape qwen3-4b --batches 8 --decode-only "${extra[@]}" --out "$OUT"
      mv "$OUT/throughput.json" "$OUT/throughput-b8-$how.json"
    done
    ;;
  hostrow)   # the prompt step's host time with the server's shapes: main against branch one-row-prompt-batch cherry-picked
             # onto it (.carry/one-row = its `git archive ... jaxinfer`), each its own process; then `determ`
    for pkg in now one-row; do
      path=.; [ $pkg != now ] && path=.carry/$pkg:.
      step 100 env PYTHONPATH=$path python3 bench/host_prompt_step.py --fresh-prompt-attention --out "$OUT"
      mv "$OUT/host_prompt_step.json" "$OUT/host_prompt_step-$pkg.json"
    done
    step 120 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants profiled-deterministic \
         --out "$OUT"
    ;;
  b8fp)      # are batch 8's greedy tokens stable across processes once XLA's autotuning is pinned? (the seventeenth
             # round's runs 4 and 6 gave be47710b4305 and 3f2b72ccf011 with the same package; B1's and B32's were
             # stable). Two lazily compiled B8 engines as now, then two sharing XLA's per-fusion autotune cache
             # (the first writes it, the second reads it). Predicted: the pinned pair agrees; the plain pair may not
    for i in 1 2; do
      step 120 python3 bench/throughput.py --shape qwen3-4b --batches 8 --decode-only --lazy-compile --out "$OUT"
      mv "$OUT/throughput.json" "$OUT/throughput-b8-plain-$i.json"
    done
    for i in 1 2; do
      step 120 env XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/xla-autotune" python3 bench/throughput.py \
           --shape qwen3-4b --batches 8 --decode-only --lazy-compile --out "$OUT"
      mv "$OUT/throughput.json" "$OUT/throughput-b8-pinned-$i.json"
    done
    ;;
  ncu)       # the decode step's Pallas kernels under Nsight Compute (never used here before; Firecracker machines read
             # the counters): per kernel duration, DRAM throughput, registers, occupancy and its limiter, at batch 1
             # and 8 (bench/ncu_kernels.py; what NOTES' round 18 predicts for them). On the H200 ncu's own
             # process segfaults on this workload (round 19, calls 1-8): ncu3 profiles the kernels alone
    step 420 python3 bench/ncu_kernels.py --shape qwen3-4b --batches 1 8 --timeout 120 --out "$OUT"
    ;;
  ncu2)      # ncu's front-end crashed on the engine's workload (calls 2-8): the decode step on an unwritten cache
             # (no prompt step: no cuDNN, no cuBLAS) at batch 1 and 8, then the engine's requests with the prompt's
             # attention on our kernel instead of cuDNN (round 19)
    python3 -c "from bench.random_model import bench_model; bench_model('/tmp/jaxinfer-bench-models', 'qwen3-4b')"
    step 160 python3 bench/ncu_kernels.py --shape qwen3-4b --batches 1 8 --workload synthetic --skip 300 \
         --timeout 70 --out "$OUT"
    step 80 python3 bench/ncu_kernels.py --shape qwen3-4b --batches 1 --workload no-cudnn --timeout 70 --out "$OUT"
    ;;
  mgpu)      # the Mosaic GPU (wgmma/TMA) prompt GEMM with fused epilogues against XLA's GEMM + epilogue at Qwen3-4B's
             # prefill projections (round 20); then the GPU tests unrun since round 19
    step 300 python3 bench/kernels/hopper_gemm.py --shape qwen3-4b --rows 1024 8192 --out "$OUT"
    step 150 python3 -m pytest -q -o addopts= tests/gpu/test_rope_kv_write_gpu.py tests/gpu/test_parity_gpu.py -k \
         "rope or float32"
    ;;
  mgpu2)     # after mgpu: the Mosaic GEMM at the other token buckets (128-4,096 rows), its GPU tests, then the 1k prompt
             # step with it against without (hopper_gemm's table emptied), alternating, each its own process, and
             # issue 4's TTFT table (round 20; predictions in NOTES)
    step 200 python3 bench/kernels/hopper_gemm.py --shape qwen3-4b --rows 128 256 512 2048 4096 --configs best --out "$OUT"
    step 60 python3 -m pytest -q -o addopts= tests/gpu/test_hopper_gemm_gpu.py
    prefill_ab 90 no-hopper default no-hopper default
    step 150 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas reference --out "$OUT"
    ;;
  mgpu3)     # after mgpu2 (the 1k step only -0.1-0.2 ms faster with the Mosaic GEMM, against -1.7 ms in isolation): the
             # step traced with and without it (each kernel's time in the step), then batch-1 decode with o_proj at
             # block_in 128 against the default again (round 20)
    step 120 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants profiled-with-cmdbuf \
         profiled-no-hopper --out "$OUT"
    step 200 python3 bench/decode_dispatch.py --shape qwen3-4b --variants oproj-in128+greedy default+greedy --out "$OUT"
    ;;
  mgpu4)     # mgpu3's trace had no Mosaic kernel in the step (the split layers' matrices reach the ops as one-layer
             # stacks, which the table's lookup refused): with that fixed, the 1k step traced with and without, an
             # unprofiled pair, then issue 4's TTFT (round 20)
    step 120 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants profiled-with-cmdbuf \
         profiled-no-hopper --out "$OUT"
    mv "$OUT/prefill_dispatch.json" "$OUT/prefill_dispatch-profiled.json"
    step 90 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default no-hopper --out "$OUT"
    step 120 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas --out "$OUT"
    ;;
  mgpu5)     # the Mosaic GEMM with its ring kept across a CTA's tiles (HopperConfig.carry; round 20, GPU-unrun):
             # its GPU tests, the kernel bench at 1k and 8k with the carry configs beside the best plain ones, then
             # the 1k step alternating: the table as committed / its rows at the fastest configs of this run /
             # without the kernel (each its own process; predictions in NOTES), one traced step of the fastest
             # (~8-9 min: a call's 10 minutes hold it only if the steps run short of their limits; mgpu6 is the
             # rest, with HOPPER_JSON=bench/results/<this call's kernels_hopper_gemm.json> once committed)
    step 60 python3 -m pytest -q -o addopts= tests/gpu/test_hopper_gemm_gpu.py
    step 150 python3 bench/kernels/hopper_gemm.py --shape qwen3-4b --rows 1024 8192 --configs carry --out "$OUT"
    prefill_ab 80 default hopper-fastest no-hopper
    step 80 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants profiled-hopper-fastest \
         --out "$OUT"
    ;;
  mgpu6)     # mgpu5's step A/B again in another order (HOPPER_JSON: mgpu5's kernels_hopper_gemm.json, committed)
    prefill_ab 80 no-hopper hopper-fastest default no-hopper hopper-fastest default
    ;;
  mgpu7)     # round 21: the Mosaic GEMM's GPU tests without carry / in-flight (removed), its sweep at 1k
             # against XLA on separate weight arrays (the old stacked array's slices suspected of a copy before
             # cuBLAS), with 128-deep k steps and wave-friendly widths; the 1k step traced (the Mosaic kernels
             # named by epilogue), then the table at this sweep's fastest configs against the table as committed
    step 60 python3 -m pytest -q -o addopts= tests/gpu/test_hopper_gemm_gpu.py
    step 200 python3 bench/kernels/hopper_gemm.py --shape qwen3-4b --rows 1024 --out "$OUT"
    step 80 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants profiled-with-cmdbuf \
         --out "$OUT"
    mv "$OUT/prefill_dispatch.json" "$OUT/prefill_dispatch-profiled.json"
    prefill_ab 80 hopper-fastest default
    ;;
  mgpu8)     # the table at mgpu7's fastest configs (QKV 64x192/4, gate/up 64x128/3 at 1k), committed: its GPU
             # tests, the 1k step against no Mosaic kernel alternating twice, the TTFT table at 1k and 8k, and QKV's
             # 192-wide tile at 8k rows (~7 min)
    step 60 python3 -m pytest -q -o addopts= tests/gpu/test_hopper_gemm_gpu.py
    prefill_ab 80 default no-hopper default no-hopper
    step 150 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas --out "$OUT"
    step 80 python3 bench/kernels/hopper_gemm.py --shape qwen3-4b --rows 8192 --only qkv --out "$OUT"
    ;;
  mgpu9)     # the GPU tests at the mended tolerance; the table's 1k configs beside neighbours (snake width,
             # stages, epilogue width), then the 1k step at the fastest of them against the table, alternating (~6 min)
    step 60 python3 -m pytest -q -o addopts= tests/gpu/test_hopper_gemm_gpu.py
    step 100 python3 bench/kernels/hopper_gemm.py --shape qwen3-4b --rows 1024 --only qkv gate_up --configs table \
         --out "$OUT"
    prefill_ab 80 hopper-fastest default hopper-fastest default
    ;;
  cmdbuf2)   # the 1k prompt step with XLA's command buffers off against on, alternating (the TTFT's ~0.5 ms between
             # the call and the device's start is cuGraphLaunch of a ~340-kernel graph; kernels launched one by one
             # start at once; round 21, ~4 min)
    prefill_ab 80 default no-cmdbuf default no-cmdbuf
    ;;
  skinny1)   # round 21, GPU-unrun: the Mosaic GEMM with its warpgroups split along N (HopperConfig.split_n)
             # and K split in ranges (split_k) on decode rows padded to 64: its GPU tests, then
             # kernels_hopper_skinny.py against the engine's skinny GEMM / XLA at 8-64 rows (~6 min; NOTES)
    step 90 python3 -m pytest -q -o addopts= tests/gpu/test_hopper_gemm_gpu.py
    step 300 python3 bench/kernels/hopper_skinny.py --shape qwen3-4b --rows 8 16 32 64 --out "$OUT"
    ;;
  flash1)    # round 22: the Mosaic GPU flash attention for a fresh prompt (pallas/hopper_attention.py): its
             # GPU tests beside cuDNN's error, the kernel against cuDNN / XLA at 1k-8k tokens, then the 1k step with
             # it in place of cuDNN against the default, alternating (~8 min)
    step 150 python3 -m pytest -q -o addopts= tests/gpu/test_hopper_attention_gpu.py
    step 120 python3 bench/kernels/hopper_attention.py --tokens 1024 2048 8192 --out "$OUT"
    prefill_ab 80 hopper-flash default hopper-flash
    ;;
  flash2)    # flash1's kernel with its compute warpgroups in ping-pong (and without, as a config): GPU tests, the kernel
             # against cuDNN at 1k-8k, the 1k step against the default alternating twice (~7 min)
    step 150 python3 -m pytest -q -o addopts= tests/gpu/test_hopper_attention_gpu.py
    step 120 python3 bench/kernels/hopper_attention.py --tokens 1024 2048 8192 --out "$OUT"
    prefill_ab 80 hopper-flash default hopper-flash default
    ;;
  flash3)    # the flash kernel persistent (one CTA an SM walking items, its ring streaming the next item's loads under
             # the last one's end) against one CTA an item: GPU tests, ptxas's registers and spills, the kernel against
             # cuDNN at 1k-8k, the 1k step against the default alternating twice (~7 min)
    step 150 python3 -m pytest -q -o addopts= tests/gpu/test_hopper_attention_gpu.py
    step 60 env MOSAIC_GPU_DUMP_PTXAS=1 python3 -c "
import jax, jax.numpy as jnp
from jaxinfer.pallas import hopper_attention as ha
q = jnp.ones((1024, 32, 128), jnp.bfloat16); k = jnp.ones((1024, 8, 128), jnp.bfloat16)
ha.fresh_prompt_flash(q, k, k, 0.088).block_until_ready()" 2>&1 | grep -iE "spill|registers|smem|stack" | head -20
    step 150 python3 bench/kernels/hopper_attention.py --tokens 1024 2048 8192 --out "$OUT"
    prefill_ab 80 hopper-flash default hopper-flash default
    ;;
  flash4)    # the flash kernel in hopper_attention.TABLE (1k-2k): the bf16 engine-level test of a fresh 1k prompt through
             # it and cuDNN against float32, then issue 4's TTFT table at 1k and 8k (~5 min)
    step 200 python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py -k "cudnn_attention and fresh" -s
    step 150 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas --out "$OUT"
    ;;
  flash5)    # flash4's engine-level test again: there the flash path loaded the cuDNN path's executable from the
             # executable cache (its key does not see hopper_attention.TABLE); the test now compiles afresh (~2 min)
    step 200 python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py -k "cudnn_attention and fresh" -s
    ;;
  flash6)    # the flash kernel's GPU tests (two Q buffers, ping-pong off; the overlap, run in round 23, is gone),
             # its configs against cuDNN at 1k-8k, then the 1k step: the default (flash, ring 2) against two Q buffers
             # and cuDNN (~7 min; adopt a config only where both the kernel bench and the step show it)
    step 150 python3 -m pytest -q -o addopts= tests/gpu/test_hopper_attention_gpu.py
    step 150 python3 bench/kernels/hopper_attention.py --tokens 1024 2048 8192 --out "$OUT"
    prefill_ab 80 default hopper-flash-2q cudnn-attention default
    ;;
  trace1)    # round 23: the 1k step's kernels traced as the step is now (flash attention for the prompt),
             # the graph cut at custom calls against the default (TTFT: does the device start earlier?), then
             # bench/prefill.py's 1k twice, each its own process (~5 min)
    prefill_ab 80 profiled-with-cmdbuf default cmdbuf-no-custom default cmdbuf-no-custom
    for i in 1 2; do
      step 100 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 --paths pallas --out "$OUT"
      mv "$OUT/prefill.json" "$OUT/prefill-1k-$i.json"
    done
    ;;
  rawgaps)   # round 23: does a prompt step's call return before the step before it has run (the
             # raw loop's 13.2 ms a step against a traced device span of 12.16)? Two processes (~2 min)
    prefill_ab 80 default default
    ;;
  split1)    # the 1k prompt step as two executables (its first 3, 6 or 12 layers apart) against one, and the
             # read-back that polls readiness, alternating, each its own process; first the flash kernel's GPU
             # tests (~8 min). It also ran spin-read-back and split-6-spin, removed with the option after it
    step 150 python3 -m pytest -q -o addopts= tests/gpu/test_hopper_attention_gpu.py   # P's buffer changed (d20d98a)
    prefill_ab 80 default split-6 default split-6 split-3 split-12
    ;;
  split2)    # bench/prefill.py 1k and 8k with and without the split (one process), then one request of split-6
             # traced on one clock (~7 min)
    step 330 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas pallas-split6 --out "$OUT"
    VARIANTS=host-trace-split-6 bash "$0" timeline
    ;;
  issue4a)   # issue 4's table for Qwen3-4B in one run: 128-32,768 tokens, the Pallas path (as the engine now runs
             # it), the XLA reference path and transformers on the same GPU (~9 min; JSON written row by row)
    step 560 python3 bench/prefill.py --shapes qwen3-4b --prompts 128 1024 8192 32768 --paths pallas reference hf \
         --out "$OUT"
    ;;
  issue4b)   # the same for Llama-3-8B (~9 min; the XLA reference last: at 32k its prefixed chunks' scores take
             # 32 GB a layer and its autotuner runs out of memory, so it may not finish in the step's time)
    step 560 python3 bench/prefill.py --shapes llama3-8b --prompts 128 1024 8192 32768 --paths pallas hf reference \
         --out "$OUT"
    ;;
  issue4c)   # issue4a's rows that its time limit cut off: Qwen3-4B at 32k by transformers and the XLA reference
    step 560 python3 bench/prefill.py --shapes qwen3-4b --prompts 32768 --paths pallas hf reference --out "$OUT"
    ;;
  finnorm)   # batched decode's o_proj split-K finish and the MLP RMSNorm as one kernel (pallas/residual_norm.py):
             # its GPU tests, then batch 8 and 32 decode, the package before (.carry/before-finnorm = `git archive
             # REV jaxinfer` of the commit before it) against now, alternating, each its own lazily compiled engine
    step 120 python3 -m pytest -q -o addopts= tests/gpu/test_residual_norm_gpu.py tests/gpu/test_skinny_gemm_gpu.py
    i=0
    for pkg in ${PKGS:-before-finnorm now before-finnorm now}; do
      i=$((i + 1)); path=.; [ $pkg != now ] && path=.carry/$pkg:.
      step 150 env PYTHONPATH=$path python3 bench/throughput.py --shape qwen3-4b --batches 8 32 --decode-only \
           --lazy-compile --out "$OUT"
      mv "$OUT/throughput.json" "$OUT/throughput-$i-$pkg.json"
    done
    ;;
  warmsplit) # the server's cold and warm start with the split prompt step as the GPU default (94 executables at
             # start against 78 before it; warm was 11.7 s in round 6, target 30)
    serve_setup
    step 300 python3 bench/warm_start.py --serve --shape qwen3-4b --max-num-seqs 256 --runs 2 --out "$OUT"
    ;;
  hostout)   # the mixed step's outputs in pinned host memory against the default, alternating (~4 min)
    prefill_ab 80 default host-outputs default host-outputs
    ;;
  timeline)  # one 1k request traced on the host and the device on one clock: when does the device start?
    prefill_ab 80 ${VARIANTS:-host-trace}
    ;;
  tracedwall) # the same raw steps timed with and without the profiler on (traced span 12.16 ms a step, raw 13.2)
    prefill_ab 80 profiled-with-cmdbuf profiled-with-cmdbuf
    ;;
  skinny2)   # batch 8 and 32 decode with the products where the kernel beat the engine's at those rows in skinny1's
             # sweep (HOPPER_SKINNY_JSON: its kernels_hopper_skinny.json, committed), against the engine as it is,
             # lazily compiled engines, each its own process (~8 min)
    for b in 8 32; do
      step 130 python3 bench/throughput.py --shape qwen3-4b --batches $b --decode-only --lazy-compile \
           --hopper-decode-table "$HOPPER_SKINNY_JSON" --hopper-decode-rows $b --out "$OUT"
      mv "$OUT/throughput.json" "$OUT/throughput-b$b-hopper.json"
      step 130 python3 bench/throughput.py --shape qwen3-4b --batches $b --decode-only --lazy-compile --out "$OUT"
      mv "$OUT/throughput.json" "$OUT/throughput-b$b-now.json"
    done
    ;;
  ncu3)      # each of our kernel families alone under ncu (it crashed on every engine workload, calls 2-11; alone
             # it works, call 12): registers, occupancy, waves, DRAM throughput; batch 1's GEMVs and attention, batch
             # 8's attention and tensor-core GEMMs (~2 min; round 19)
    for w in qkv gate-up o-proj down attention-rope; do
      step 60 python3 bench/ncu_kernels.py --shape qwen3-4b --batches 1 --workload $w --skip 1 --count 2 --tokens 4 \
           --timeout 45 --out "$OUT"
    done
    for w in attention-rope skinny skinny-gate-up skinny-down; do
      step 60 python3 bench/ncu_kernels.py --shape qwen3-4b --batches 8 --workload $w --skip 1 --count 2 --tokens 4 \
           --timeout 45 --out "$OUT"
    done
    ;;
  ncugemv)   # the batch-1 GEMVs' registers, occupancy and waves by block_in and rows a program, under ncu (~3 min):
             # o_proj ran at 98 registers (16 blocks an SM, 1.21 waves) in call 12 of round 19
    for w in o-proj down qkv; do
      for bi in 128 256 512; do
        for r in 1 2; do
          step 40 python3 bench/ncu_kernels.py --shape qwen3-4b --batches 1 --workload $w --block-in $bi --rows $r \
               --skip 1 --count 1 --tokens 3 --timeout 35 --out "$OUT"
        done
      done
    done
    ;;
  oproj)     # batch-1 Qwen3-4B step with o_proj at block_in 128 / 512 or 2 rows a program against the default, each its
             # own process (decode_dispatch.py; pick by ncugemv's registers and waves first; round 19)
    step 420 python3 bench/decode_dispatch.py --shape qwen3-4b --variants default+greedy oproj-in128+greedy \
         oproj-in512+greedy oproj-rows2+greedy --out "$OUT"
    ;;
  hostab)    # the prompt step's host work (round 19: the batch handed to the step as a numpy buffer,
             # pack's dtype names cached, integer prompts checked with numpy) against the package before it
             # (.carry/before-host = `git archive 7f57a06 jaxinfer`), alternating, each its own process; then
             # issue 4's 1k TTFT share with the package now. Predictions in NOTES (round 19)
    python3 -c "from bench.random_model import bench_model; bench_model('/tmp/jaxinfer-bench-models', 'qwen3-4b')"
    i=0
    for pkg in ${PKGS:-before-host now before-host now}; do
      path=.; [ $pkg != now ] && path=.carry/$pkg:.; i=$((i + 1))
      step 90 env PYTHONPATH=$path python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default \
           --out "$OUT"
      mv "$OUT/prefill_dispatch.json" "$OUT/prefill_dispatch-$i-$pkg.json"
    done
    step 90 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 --paths pallas --out "$OUT"
    ;;
  state)     # the round's last call: issue 3's batch-1 share (Pallas against the XLA reference path) and issue 4's
             # 1k TTFT share, with the package as it ends the round
    step 170 python3 bench/decode.py --shapes qwen3-4b --paths pallas reference --long --out "$OUT"
    step 90 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 --paths pallas --out "$OUT"
    ;;
  gateup)    # gate/up with its SwiGLU epilogue on the Pallas GEMM at 1k prompt rows (round 8's prefill sweep
             # reached QKV, 0.90x XLA, and o_proj, 0.77x, not gate/up): the sweep, then the 1k prompt step with the
             # sweep's best config in the prefill table (the SiLU-multiply kernel and cuBLAS's memset gap go)
    step 200 python3 bench/kernels/skinny_gemm.py --prefill --sweep --budget 120 --models qwen3-4b --epilogues swiglu \
         --ms 1024
    step 200 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default prefill-table \
         --out "$OUT"
    ;;
  tiledparity) # after the prompt kernel's tiles became the default (68c293d), batch 1's and 8's greedy fingerprints
             # moved (run 3): the GPU's float32 greedy parity with the reference and the kernel's GPU test, then batch
             # 1 with the token loop against the tiles (the fingerprints' cause). The token loop and its rope-loop
             # variant are gone (round 19): the last step no longer runs as written
    step 240 python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py tests/gpu/test_rope_kv_write_gpu.py -k "float32 or rope_kv_write"
    step 150 python3 bench/decode_dispatch.py --shape qwen3-4b --variants default+greedy rope-loop+greedy --out "$OUT"
    ;;
  mergelast) # (no longer runs: merge "last" was removed after this round measured it slower, round 18; the
             # code is at 463839f) decode attention's splits merged by the last program to finish (SplitConfig.merge "last": no merge
             # kernel, no launch between; counters threaded through the layers): GPU parity (20 calls threading the
             # counters, bit-equal outputs, exact counters), the kernel sweep with and without, the batch-1 step A/B,
             # batch 8 (lazy engines, XLA's autotuning shared). Predicted in NOTES (round 18)
    step 150 python3 -m pytest -q -o addopts= tests/gpu/test_decode_attention_rope_gpu.py
    step 150 python3 bench/kernels/decode_attention_rope.py --merge-last --budget 100 --points 1:1024 8:1024 8:2048
    step 120 python3 bench/decode_dispatch.py --shape qwen3-4b --variants default+greedy merge-last+greedy \
         --out "$OUT"
    for v in plain last; do
      extra=(); [ $v = last ] && extra=(--attention-merge-last)
      step 100 env XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/xla-autotune" python3 bench/throughput.py \
           --shape qwen3-4b --batches 8 --decode-only --lazy-compile "${extra[@]}" --out "$OUT"
      mv "$OUT/throughput.json" "$OUT/throughput-b8-$v.json"
    done
    ;;
  prefetch)  # (no longer runs: SplitConfig.prefetch was removed after this round measured it slower, eighteenth
             # round; the code is at f8fd696) the RoPE-fused decode attention with each block's loads a block ahead, the first before the new token's
             # norm/RoPE (SplitConfig.prefetch; outputs equal bit for bit in the interpret tests): the kernel sweep
             # with and without it, the batch-1 step A/B (same tokens expected), then batch 8 (engines compiled
             # lazily, XLA's autotuning pinned by a shared cache so that the tokens compare). Predicted in NOTES
    step 200 python3 bench/kernels/decode_attention_rope.py --prefetch --budget 150 --points 1:1024 4:1024 8:1024 \
         8:2048 32:1024
    step 120 python3 bench/decode_dispatch.py --shape qwen3-4b --variants default+greedy attn-prefetch+greedy \
         --out "$OUT"
    for v in plain prefetch; do
      extra=(); [ $v = prefetch ] && extra=(--attention-prefetch)
      step 120 env XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/xla-autotune" python3 bench/throughput.py \
           --shape qwen3-4b --batches 8 --decode-only --lazy-compile "${extra[@]}" --out "$OUT"
      mv "$OUT/throughput.json" "$OUT/throughput-b8-$v.json"
    done
    ;;
  ropetiled) # the 1k prompt step with the norm/RoPE/cache-write kernel's tokens as tiles (rope_kv_write.TILED; 13.5 us
             # a layer as a token loop, ~2.4x its bytes): TTFT A/B, the same first token expected, then its trace
    step 260 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default rope-tiled \
         rope-tiled-16 rope-tiled-32 profiled-rope-tiled --out "$OUT"
    ;;
  determ)    # the same memsets with XLA told to exclude nondeterministic ops (no cross-tile atomic reductions)
    step 120 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants profiled-deterministic \
         --out "$OUT"
    ;;
  memsets)   # the 1k prompt step's memsets (round launch: 108 a step, 3 a layer, before gate/up's and o_proj's
             # GEMMs and cuDNN's attention, each followed by ~5 us idle: ~0.5 ms of the 13.8 ms step) and its launch
             # (cuGraphLaunch was most of it): XLA flag variants, each profiled, each its own process
    step 480 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants profiled-with-cmdbuf \
         profiled-concurrent profiled-cublaslt-on profiled-cublaslt-off profiled-skip-profiled --out "$OUT"
    ;;
  launch)    # what the 1k prompt step's ~1.3 ms launch is (it did not move with 148 against 292 weight arrays, run 1):
             # one request traced on the host (the runtime's scopes by total time); then the device trace with
             # memsets counted (are they the 5-6 us gaps before every gate/up GEMM and cuDNN attention?)
    step 300 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default host-trace \
         profiled-with-cmdbuf --out "$OUT"
    ;;
  b8ab)      # round 14's last call: batch 8's new decode attention row (SplitConfig(8, 64), swept in
             # b8attn: 13.4 against the old row's 15.7 us at 1k) in the step, against the old row forced
             # (--attention-config 4/64), each its own process. Predicted: B8 step -0.08 ms (2.3 us x 36 layers).
             # First a sweep of batch 16 and 32 at 1-2k contexts (their rows were swept at 8k or not at all)
    step 120 python3 bench/kernels/decode_attention.py --sweep --no-table --points 32:1024 32:2048 16:1024 16:2048 \
         --budget 90
    step 220 python3 bench/throughput.py --shape qwen3-4b --batches 8 --decode-only --out "$OUT"
    mv "$OUT/throughput.json" "$OUT/throughput-b8-new-row.json"
    step 220 python3 bench/throughput.py --shape qwen3-4b --batches 8 --decode-only --attention-config 4/64 --out "$OUT"
    mv "$OUT/throughput.json" "$OUT/throughput-b8-old-row.json"
    ;;
  arrays)    # round 14's first call (~8 min): greedy parity after the vectors stayed stacked (float32,
             # float8 pages: the fused GEMV and skinny GEMM now read them at their own layer), then the A/B that the
             # round 13 had no device time for, each variant its own process in one run: the step's arrays
             # 148 (default) against 292 (split-every-array). Predicted: prefill launch -0.3 ms, decode raw unchanged.
             # Then the layers as a rolled scan over stacked arrays (a dozen), with XLA's dynamic slice fusion and the
             # loop in the command buffer, and without (round 13's unrolled stacked variant copied the
             # slices: raw 14.2 -> 18.1 ms). If rolled-dsf-while's raw step holds and its launch drops, it is the layout.
             # unpacked-batch: the prompt step's batch as ~20 arrays split by a call of its own (predicted +0.1-0.15 ms)
    JAXINFER_PRINT_FAILURES=1 step 170 python3 -m pytest -q -p no:warnings -o addopts= tests/gpu/test_parity_gpu.py \
         -k "float32 or float8"
    step 230 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default split-every-array \
         unpacked-batch rolled-dsf-while rolled --out "$OUT"
    step 150 python3 bench/decode_dispatch.py --shape qwen3-4b --variants default+greedy \
         default+greedy+split-every-array default+greedy+rolled-dsf-while --out "$OUT"
    ;;
  prefixspan) # a cached 2,048-token prefix's TTFT by the page table's span (4,096 against the server's 40,960) and the
             # chunk's attention (prefixed cuDNN, which gathers the whole span, against the paged kernel); by arithmetic
             # the gather at 40,960 is ~12 GB a step (~2.7 ms) for a 1,024-token chunk
    step 330 python3 bench/prefix_span.py --shape qwen3-4b --system 2048 --new 8 1024 --spans 4096 40960 --out "$OUT"
    ;;
  b8attn)    # batch 8's decode attention (issue 5: B8 at 60.9% of its roofline; its attention 17.6 us a layer for
             # 33.6 MB of KV, ~7.5 us at the read ceiling). In the engine B8 x 8 KV heads with a span > 1,024 takes
             # the table's (128, any span) row, SplitConfig(4, 64), swept at batch 16 and 8k: sweep B8 (and B2, B4)
             # at 1k and 2k contexts for a row of its own
    step 330 python3 bench/kernels/decode_attention.py --sweep --points 8:1024 8:2048 4:1024 2:1024 --budget 280
    step 150 python3 bench/throughput.py --shape qwen3-4b --batches 8 --requests 20 --system 64 --out "$OUT"
    ;;
  kernels)   # per-kernel tables for the open issues' notes, traced with command buffers on (the benches set the flag):
             # batch-1 decode (issue 3), the 1k prefill (issue 4), batched decode at 8 and 64 (issue 5)
    step 150 python3 bench/decode.py --shapes qwen3-4b --paths pallas --profile pallas --out "$OUT"
    step 150 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 --paths pallas --profile pallas:1024 --out "$OUT"
    step 270 python3 bench/throughput.py --shape qwen3-4b --batches 1 8 64 --requests 30 --system 64 --profile 8 64 --out "$OUT"
    ;;
  vminor)    # the sampler table (round 13, run 2: the search laid out [B, 16, V] lost; that variant is gone)
    step 150 python3 bench/kernels/sampling.py --rows 1 8 64 --calls 8 --out "$OUT"
    ;;
  issue6)    # issue 6's targets in one call: the engine's batch-1 step (bench/decode.py), the server with greedy requests
             # at 1 and 2 req/s and all at once (with the PNG), and offline with the engine built as the server builds it
    serve_setup
    M=/tmp/jaxinfer-bench-models/qwen3-4b
    step 100 python3 bench/decode.py --shapes qwen3-4b --paths pallas --out "$OUT"
    step 280 python3 bench/serving.py --serve-model $M --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64" \
         --request-rates ${RATES:-1,2,inf} --num-prompts 64 --input-len 1024 --output-len 128 --extra-body '{"temperature": 0}' \
         --out "$OUT/serving.json" --plot "$OUT/serving.png" --client aiohttp
    step 120 python3 -m jaxinfer.cli bench --model $M --dtype bfloat16 --ops pallas --input-len 1024 --output-len 128 \
         --batch-size 64 --num-prompts 64 --like-serve --max-model-len 40960
    ;;
  rows)      # round 12's third call: sampling by rows (a one-sequence prompt step samples its one row;
             # "filter" without the radix search, at every row count; filter-p only above 2 rows) through the server
             # with Qwen3's filters (its first server starts cold: ~2 min of compiling, 83 steps in the eleventh
             # round); then greedy at 1 req/s (issue 6's light load), with the GIL's switch interval at 0.5 ms
             # (sitecustomize) and without; then top-p 0.9 alone. Round 11, 2 req/s: top-p 0.9 TTFT p50
             # 29.3 ms, TPOT 3.34 ms
    serve_setup
    servers 250 '{"temperature": 0.6, "top_k": 20, "top_p": 0.95}' topk ""
    RATE=1 servers 90 '{"temperature": 0}' greedy1 ""
    mkdir -p /tmp/sc && echo 'import sys; sys.setswitchinterval(0.0005)' > /tmp/sc/sitecustomize.py
    PYTHONPATH=$PYTHONPATH:/tmp/sc RATE=1 servers 90 '{"temperature": 0}' greedy1-switch ""
    servers 100 '{"temperature": 0.6, "top_p": 0.9}' topp ""
    ;;
  rows2)     # the third: the sampler table at 1, 8 and 64 rows (filter without the radix search; filter-p on top-k
             # rows = what the search costs; at 1 row, whether the sort still wins: SORT_MAX_ROWS)
    step 300 python3 bench/kernels/sampling.py --rows 1 8 64 --calls 8 --out "$OUT"
    ;;
  twelfth)   # round 12's first call: the whole GPU parity file again (one-sequence prompt steps now sample
             # one row: the cuDNN tests run them; the filter split: the sampling test), its engines compiling only
             # the steps they run (compile_at_start=False; round 11's two calls took ~950 s)
    JAXINFER_PRINT_FAILURES=1 step 560 python3 -m pytest -q -p no:warnings -o addopts= --durations=0 \
         tests/gpu/test_parity_gpu.py
    ;;
  eleventh2) # round 11's second call: the first call ran 7 of the 10 tests in its 560 s; both cuDNN tests
             # failed on the step-name check (steps now carry the sampling variant: "mixed-plain-fresh"), now mended.
             # Those two and the three it did not reach, each failure printed as it happens
    JAXINFER_PRINT_FAILURES=1 step 430 python3 -m pytest -q -p no:warnings -o addopts= --durations=0 \
         tests/gpu/test_parity_gpu.py -k "cudnn or read_back or behind or without_the_sort"
    ;;
  topk2)     # round 11's fourth call: topk's sampler table reached only 1 row in its 80 s (each row count
             # compiles nine samplers); 8 and 64 rows
    step 250 python3 bench/kernels/sampling.py --rows 8 64 --calls 8 --out "$OUT"
    ;;
  topk)      # the second: the sampler's variants alone (the filter one unmeasured), then sampled requests with Qwen3's
             # recommended filters (top-k 20, top-p 0.95: the "-filter" variant) through the server with and without
             # plain_sampling_step, then with Llama 3's (top-p 0.9 alone: the radix search) with it
    step 80 python3 bench/kernels/sampling.py --rows 1 8 64 --calls 8 --out "$OUT"
    serve_setup
    servers 140 '{"temperature": 0.6, "top_k": 20, "top_p": 0.95}' topk plain-sampling-step no-plain-sampling-step
    servers 140 '{"temperature": 0.6, "top_p": 0.9}' topp ""
    ;;
  plain)     # round 10's fourth call: the sampler's variants alone (plain = no sort), then sampled requests
             # (temperature 0.8) through the server with plain_sampling_step (now the GPU default) and without.
             # (Its third call, `branch`, compared the flag plain_sampling_step replaced, --no-sampling-branch, at e817e44.)
    step 100 python3 bench/kernels/sampling.py --rows 1 8 64 --calls 8 --out "$OUT"
    serve_setup
    servers 140 '{"temperature": 0.8}' sampled plain-sampling-step no-plain-sampling-step
    ;;
  sampled)   # after tenth: sampled requests (temperature 0.8: the mixed-fresh step, CPU-tested only) through the
             # server with and without the fresh op at 2 req/s
    serve_setup
    servers 90 '{"temperature": 0.8}' sampled fresh-prompt-attention no-fresh-prompt-attention
    ;;
  ninth)     # round 9's second call, after prefill_behind_decode and fresh_prompt_attention became GPU
             # defaults: GPU parity (with a fresh 1,000-token prompt on cuDNN against the paged kernel), the fresh op's
             # crossover (prompts 128-8,192), prefill 1k/8k with and without it, the server's defaults at 2 and 8 req/s
    step 300 python3 -m pytest -q -p no:warnings -o addopts= tests/gpu/test_parity_gpu.py
    step 120 python3 bench/kernels/prefill_attention.py --fused
    step 170 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas pallas-paged --out "$OUT"
    serve_setup
    step 120 python3 bench/serving.py --serve-model /tmp/jaxinfer-bench-models/qwen3-4b \
         --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64" \
         --request-rates ${RATES:-2,8} --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving-defaults.json" \
         --client aiohttp
    ;;
  chain)     # round 9's third call: the fresh prompt's bf16 parity against float32 (beside the other bf16
             # paths), the 1k prefill's kernels traced (issue 4's breakdown), then the server's defaults against
             # --chain-early-ms ${CHAIN_MS:-1} side by side at 2 and 8 req/s (issue 6's TPOT)
    step 150 python3 -m pytest -q -s -p no:warnings -o addopts= tests/gpu/test_parity_gpu.py -k fresh_prompt
    step 90 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 --paths pallas --profile pallas:1024 --out "$OUT"
    serve_setup
    for v in "" "--chain-early-ms ${CHAIN_MS:-1}"; do
      step 120 python3 bench/serving.py --serve-model /tmp/jaxinfer-bench-models/qwen3-4b \
           --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64 $v" --request-rates ${RATES:-2,8} \
           --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving-chain${v:+-early}.json" --client aiohttp
    done
    ;;
  attn)      # issue 4's 1k prefill (16.2 ms on the device, ~15 targeted): cuDNN's flash attention for a step that
             # is one fresh prompt (fresh_prompt_attention, built in round 8): its GPU test, the kernel
             # bench beside the paged flash kernel, then the 1k prefill step with and without it
    step 120 python3 -m pytest -q -p no:warnings -o addopts= tests/gpu/test_fresh_prompt_attention_gpu.py
    step 240 python3 bench/kernels/prefill_attention.py --fused
    step 170 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default fresh-attention \
         --out "$OUT"
    ;;
  tpot)      # issue 6's TPOT at light load (3.16 ms against 2.98 targeted): the server loop's decode step (3.02 ms)
             # against a user's (2.67) with the late chain moved 1 and 3 ms earlier, then the server at 2 req/s
             # with the better one (CHAIN_MS, default 1)
    step 300 python3 bench/decode_dispatch.py --shape qwen3-4b --variants server-defaults+greedy \
         server-defaults+early1 server-defaults+early3 --out "$OUT"
    serve_setup
    step 150 python3 bench/serving.py --serve-model /tmp/jaxinfer-bench-models/qwen3-4b \
         --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64 --chain-early-ms ${CHAIN_MS:-1}" \
         --request-rates 2,8 --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving-early.json" \
         --client aiohttp
    ;;
  gaps2)     # then: offline like the server without and with --overlap-mixed; all at once without the heap
             # freeze; the 1k prefill with the greedy-only prompt step (prefill_dispatch times the step the
             # engine runs)
    serve_setup
    M=/tmp/jaxinfer-bench-models/qwen3-4b
    B="--model $M --dtype bfloat16 --ops pallas --input-len 1024 --output-len 128 --batch-size 64 --num-prompts 64"
    step 100 python3 -m jaxinfer.cli bench $B --like-serve
    step 100 python3 -m jaxinfer.cli bench $B --like-serve --overlap-mixed
    step 130 python3 bench/serving.py --serve-model $M \
         --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64 --no-freeze-gc" --request-rates inf \
         --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving-nofreeze.json" --client aiohttp
    step 120 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default --out "$OUT"
    ;;
  trace)     # serving with the server's device traced for a second of each rate: how busy the device is and
             # where it idles (light load: between decode dispatches; all at once: around the prefill steps);
             # first 2 req/s with the httpx client as before, then with aiohttp (vLLM's bench client)
    serve_setup
    step 150 python3 bench/serving.py --serve-model /tmp/jaxinfer-bench-models/qwen3-4b \
         --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64" --request-rates 2 \
         --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving-httpx.json" --client httpx
    step 200 python3 bench/serving.py --serve-model /tmp/jaxinfer-bench-models/qwen3-4b \
         --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64" --request-rates ${RATES:-2,inf} \
         --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving-trace.json" \
         --device-trace /tmp/traces --device-trace-seconds ${TRACE_S:-1} --client ${CLIENT:-aiohttp}
    ;;
  loaded)    # offline throughput with steps compiled in the process, then with the same steps loaded from
             # the executable cache (a server's warm start); then the GPU parity tests
    serve_setup
    B="--model /tmp/jaxinfer-bench-models/qwen3-4b --dtype bfloat16 --ops pallas --input-len 1024 --output-len 128"
    B="$B --batch-size 64 --num-prompts 64 --like-serve --max-model-len 40960"
    rm -rf ~/.cache/jaxinfer/executables
    step 120 python3 -m jaxinfer.cli bench $B
    step 100 python3 -m jaxinfer.cli bench $B
    step 150 python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py
    ;;
  gemmflags) # prefill 1k with XLA free to put any GEMM in a Triton fusion (elementwise work fused in)
    step 300 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --variants default triton-gemm-any \
         --out "$OUT"
    ;;
  profile)   # where the time goes: prefill host/launch/device split, batched decode traces
    step 200 python3 bench/prefill_dispatch.py --shape qwen3-4b --prompt 1024 --out "$OUT"
    step 380 python3 bench/throughput.py --shape qwen3-4b --requests 300 --profile 8 64 --out "$OUT"
    ;;
  1)
    step 130 python3 -m pytest -q -o addopts= tests/gpu/test_parity_gpu.py tests/gpu/test_rope_kv_write_gpu.py
    step 130 python3 bench/decode.py --shapes qwen3-4b --long llama3-8b:1024 --paths pallas reference --out "$OUT"
    step 130 python3 bench/prefill.py --shapes qwen3-4b --prompts 1024 8192 --paths pallas reference hf \
         --profile pallas:1024 --out "$OUT"
    step 200 python3 bench/throughput.py --shape qwen3-4b --requests 300 --profile 8 64 --out "$OUT"
    ;;
  2)
    if [ -d .whl ] && [ -d .carry/qwen3 ]; then
      serve_setup
      # the same workload offline, same batch size: the bar for serving throughput under load
      step 150 python3 -m jaxinfer.cli bench --model /tmp/jaxinfer-bench-models/qwen3-4b --dtype bfloat16 --ops pallas \
           --input-len 1024 --output-len 128 --batch-size 64 --num-prompts 64
      step 330 python3 bench/serving.py --serve-model /tmp/jaxinfer-bench-models/qwen3-4b \
           --serve-args "--dtype bfloat16 --ops pallas --max-num-seqs 64" --request-rates 2,8,inf --plot "$OUT/serving.png" \
           --num-prompts 64 --input-len 1024 --output-len 128 --out "$OUT/serving.json"
    fi
    ;;
esac
