#!/usr/bin/env bash
# The H200 work that the CPU cannot do for the open issues, one device call a part (each under 10 minutes):
#   part 1 (issue 38): bench/speculative.py's whole table in one run (~400 s alone; a 330 s limit cut its last case)
#   part 2 (issues 40, 43, 39): the GPU tests of the sliding-window, dense-family, MoE, tensor-parallel and
#          constrained-speculation code; tensor parallel 1's decode speed against the 2.53 ms of the table
#          (bench/RESULTS.md); the sliding-window kernels against whole-context attention; the 32k int8 cache step
#          on its own split table (tables.DECODE_ATTENTION_INT8)
#   part 3 (issue 43): experiments/moe_gpu_round.sh 2 (Qwen3-30B-A3B shape decode against transformers)
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
  grep -viE '^W[0-9]{4} |warn' "$OUT/$name.log" | tail -16
}
case "${1:-1}" in
  1)
    step speculative 560 python3 bench/speculative.py --sections verify oracle dflash batched --contexts 1024 8192 \
         --new 128 --out "$OUT"
    ;;
  2)
    step gputests 240 python3 -m pytest -q -o addopts= tests/gpu/test_sliding_window_gpu.py \
         tests/gpu/test_dense_families_gpu.py tests/gpu/test_grouped_gemm_gpu.py tests/gpu/test_tensor_parallel_gpu.py \
         tests/gpu/test_structured_spec_gpu.py
    step decode 90 python3 bench/decode.py --shapes qwen3-4b --long --paths pallas --out "$OUT"
    step sliding_window 100 python3 bench/kernels/sliding_window.py
    step decode32k 120 python3 bench/decode.py --shapes --long qwen3-4b:32768 --paths pallas --quantization int8 \
         --kv int8 --new 64 --out "$OUT"
    ;;
  3)
    OUT="$OUT" bash experiments/moe_gpu_round.sh 2
    ;;
esac
