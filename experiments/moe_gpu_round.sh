#!/usr/bin/env bash
# The mixture-of-experts families' GPU work, one device call a part (each under 10 minutes), printing as it goes:
#   part 1: the grouped GEMM / routed GEMV test at real shapes, then bench/kernels/moe.py (kernels alone: the routed
#           GEMVs' configs at batch 1, the grouped GEMM's at 64 and 1,024 tokens, each printed as measured)
#   part 2: Qwen3-30B-A3B shape (first 24 of 48 layers: the model and transformers' copy fit one H200 and its disk)
#           batch-1 decode after a 1k prompt (Pallas, XLA reference, transformers), then batch 64 decode
#   part 3: Mixtral-8x7B shape (first 8 of 32 layers) batch-1 decode (Pallas, transformers), then the 1k prefill
#           of both shapes (Pallas, XLA reference, transformers)
# The XLA reference path runs last in each bench: its ragged_dot may be far slower than the kernels (if XLA expands it
# densely, every expert multiplies every row), and a step's time limit then cuts only it off.
# Usage on the device, from the repo root: bash experiments/moe_gpu_round.sh 1|2|3   (nothing to carry)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. PYTHONFAULTHANDLER=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "## $*" | tee -a "$OUT/moe.log"; timeout "$limit" "$@" 2>&1 | grep -v -iE 'warning:|warnings\.warn|^W[0-9]{4} ' | tee -a "$OUT/moe.log"; }
case "${1:-1}" in
  1)
    step 200 python3 -m pytest -q -o addopts= tests/gpu/test_grouped_gemm_gpu.py
    step 380 python3 bench/kernels/moe.py --shapes qwen3-30b-a3b mixtral-8x7b --tokens 1 64 1024 --out "$OUT"
    ;;
  2)
    step 420 python3 bench/decode.py --shapes qwen3-30b-a3b@24 --long --paths pallas hf reference --prompt 1024 \
         --new 64 --out "$OUT"
    step 160 python3 bench/throughput.py --shape qwen3-30b-a3b@24 --ops pallas --batches 1 64 --context 1024 \
         --steps 32 --decode-only --lazy-compile --out "$OUT"
    ;;
  3)
    step 300 python3 bench/decode.py --shapes mixtral-8x7b@8 --long --paths pallas hf --prompt 1024 --new 64 \
         --out "$OUT"
    mv "$OUT/decode.json" "$OUT/decode-mixtral.json" 2>/dev/null
    step 280 python3 bench/prefill.py --shapes qwen3-30b-a3b@24 mixtral-8x7b@8 --prompts 1024 \
         --paths pallas hf reference --out "$OUT"
    ;;
esac
