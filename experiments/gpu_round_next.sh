#!/usr/bin/env bash
# The H200 work that the CPU cannot do for the open issues, one device call a part (each under 10 minutes):
#   part 1 (issues 40, 43): tensor parallel 1's decode speed against the 2.53 ms of the table (bench/RESULTS.md); the
#          Qwen3-30B-A3B shape's batch-1 decode (first 24 of 48 layers) against transformers and the XLA reference;
#          then the GPU tests of the MoE, tensor-parallel, sliding-window, dense-family and LongRoPE code
#   part 2 (issue 43): the Qwen3-30B-A3B shape at batch 64, the Mixtral-8x7B shape's batch-1 decode (first 8 of 32
#          layers) against transformers, the 1k prefill of both
#   part 3 (issues 38, 39): speculation's batched section (random and block-repeating prompts at batch 64); the 32k
#          int8 cache step on its own split table (tables.DECODE_ATTENTION_INT8)
# Usage on the device, from the repo root: bash experiments/gpu_round_next.sh 1|2|3
# Carry the Qwen3 tokenizer and stories260k in .carry/ (the GPU tests read .carry/stories260k); llguidance's wheels
# in .carry/wheels for the structured-output tests.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/pylibs PYTHONFAULTHANDLER=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d .carry/wheels ] && pip install -q --no-deps --no-index --target /tmp/pylibs .carry/wheels/*.whl > "$OUT/pip.log" 2>&1
t0=$(date +%s)
step() {   # step NAME LIMIT COMMAND...: the command's output in $OUT/NAME.log, its table lines and time printed
  local name=$1 limit=$2; shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "## $name rc=$? t=$(( $(date +%s) - t0 )) s"
  grep -viE '^W[0-9]{4} |warn' "$OUT/$name.log" | grep -v '^\s*$' | tail -${TAIL:-14}
}
case "${1:-1}" in
  1)
    step decode_tp1 95 python3 bench/decode.py --shapes qwen3-4b --long --paths pallas --out "$OUT"
    mv "$OUT/decode.json" "$OUT/decode-tp1.json" 2>/dev/null
    step moe_decode 300 python3 bench/decode.py --shapes qwen3-30b-a3b@24 --long --paths pallas hf reference \
         --prompt 1024 --new 64 --out "$OUT"
    mv "$OUT/decode.json" "$OUT/decode-qwen3moe.json" 2>/dev/null
    TAIL=30 step gputests 185 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/gpu/test_grouped_gemm_gpu.py \
         tests/gpu/test_tensor_parallel_gpu.py tests/gpu/test_sliding_window_gpu.py tests/gpu/test_dense_families_gpu.py \
         tests/gpu/test_longrope_chunks_gpu.py
    ;;
  2)
    step moe_batch64 150 python3 bench/throughput.py --shape qwen3-30b-a3b@24 --ops pallas --batches 1 64 \
         --context 1024 --steps 32 --decode-only --lazy-compile --out "$OUT"
    step mixtral_decode 250 python3 bench/decode.py --shapes mixtral-8x7b@8 --long --paths pallas hf --prompt 1024 \
         --new 64 --out "$OUT"
    mv "$OUT/decode.json" "$OUT/decode-mixtral.json" 2>/dev/null
    step moe_prefill 185 python3 bench/prefill.py --shapes qwen3-30b-a3b@24 mixtral-8x7b@8 --prompts 1024 \
         --paths pallas hf reference --out "$OUT"
    ;;
  3)
    step speculative_batched 330 python3 bench/speculative.py --sections batched --new 128 --out "$OUT"
    step decode32k 120 python3 bench/decode.py --shapes --long qwen3-4b:32768 --paths pallas --quantization int8 \
         --kv int8 --new 64 --out "$OUT"
    ;;
esac
