#!/usr/bin/env bash
# Issue 41's work on a machine of several H200s (nvidia-h200-x2, -x4 or -x8), one device call a part (each under
# 10 minutes). NVLink multicast stays off (the machine's notes); nothing here turns it on.
#   part 1: parity on the GPUs (tests/gpu/test_tensor_parallel_gpu.py: TP 2/4/8 against 1, float32 greedy tokens,
#           bf16 logits) and what one all-reduce of a decode row costs under XLA's flags (bench/collectives.py)
#   part 2: Llama-3-8B batch-1 decode after a 1k prompt at TP 1, 2 (and 4), one process each
#   part 3: Llama-3-70B batch-1 decode at TP 2, 4, 8 where they fit: the whole model (141 GB) on the x4 and x8
#           machines' 235 GB disks, its first 40 layers (73 GB) on the x2's 128 GB
# Not yet here: batch 64 and the 8k prefill at TP > 1 (bench/throughput.py and bench/prefill.py take no
# --tensor-parallel-size yet; bench/decode.py does).
# Usage on the device, from the repo root: bash experiments/multi_gpu_round.sh 1|2|3 [TP sizes for part 3]
# (nothing to carry). The 70B weights are written once (/tmp/jaxinfer-bench-models) and kept while the machine is.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. PYTHONFAULTHANDLER=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
GPUS=$(nvidia-smi -L | wc -l)
TPS=$(for n in 2 4 8; do [ "$n" -le "$GPUS" ] && echo -n "$n "; done)
echo "# $GPUS GPUs; tensor parallel sizes $TPS"
source experiments/gpu_step.sh
case "${1:-1}" in
  1)
    TAIL=20 step parity 300 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py
    # shellcheck disable=SC2086
    step collectives 260 python3 bench/collectives.py --tp $TPS --out "$OUT"
    ;;
  2)
    for n in 1 $TPS; do
      [ "$n" -gt 4 ] && continue
      step "decode-llama3-8b-tp$n" 170 python3 bench/decode.py --shapes llama3-8b --long --paths pallas \
           --tensor-parallel-size "$n" --out "$OUT"
      mv "$OUT/decode.json" "$OUT/decode-llama3-8b-tp$n.json" 2>/dev/null
    done
    ;;
  3)
    shape=llama3-70b
    [ "$GPUS" -lt 4 ] && shape=llama3-70b@40
    shift
    for n in ${@:-$TPS}; do   # part 3's sizes may be given (bash ... 3 4 8): writing 141 GB takes minutes
      step "decode-70b-tp$n" 280 python3 bench/decode.py --shapes "$shape" --long --paths pallas \
           --tensor-parallel-size "$n" --out "$OUT"
      mv "$OUT/decode.json" "$OUT/decode-70b-tp$n.json" 2>/dev/null
    done
    ;;
esac
