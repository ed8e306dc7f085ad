#!/usr/bin/env bash
# Issue 41's work on a machine of several H200s (nvidia-h200-x2, -x4 or -x8), one device call a part (each under
# 10 minutes). NVLink multicast stays off (the machine's notes); nothing here turns it on.
#   part 1: parity on the GPUs (tests/gpu/test_tensor_parallel_gpu.py: TP 2/4/8 against 1, float32 greedy tokens,
#           bf16 logits) and what one all-reduce of a decode row costs under XLA's flags (bench/collectives.py)
#   part 2: Llama-3-8B batch-1 decode after a 1k prompt at TP 1, 2 (and 4), one process each
#   part 3: Llama-3-70B batch-1 decode at TP 2, 4, 8 where they fit: the whole model (141 GB) on the x4 and x8
#           machines' 235 GB disks, its first 40 layers (73 GB) on the x2's 128 GB
#   part 4: Llama-3-8B batched decode (batch 64 at a 1k context, bench/throughput.py --decode-only) at TP 1, 2 (and 4)
#   part 5: Llama-3-8B 8k prefill (bench/prefill.py, our Pallas path) at TP 1, 2 (and 4)
#   part 6: Llama-3-70B batch 64 at TP 2, 4, 8 where they fit (the shape as part 3's)
#   part 7: Llama-3-70B 8k prefill at TP 2, 4, 8 where they fit
#   part 8: 8-bit weights split: Llama-3-8B batch-1 decode at TP 1, 2 (and 4), bf16 then int8 and fp8 in each process
# Each TP size is a process of its own; its JSON is renamed *-tpN.json. The rooflines are N devices' (throughput's
# bytes and FLOPs over N, prefill's share of N x one device's GEMM rate); the greedy tokens' hash (throughput) and the
# prompt's first token (prefill, printed at the end) are to compare with TP 1's (bf16: a sum's order may move one).
# Usage on the device, from the repo root: bash experiments/multi_gpu_round.sh 1|2|3|4|5|6|7|8 [TP sizes for 3, 6, 7]
# (nothing to carry). The 70B weights are written once (/tmp/jaxinfer-bench-models) and kept while the machine is:
# run part 3 first. Parts 3, 6 and 7 take up to ~5 minutes a TP size: give them at most two sizes a call
# (bash ... 6 2 4, then bash ... 6 8) so that a call stays under 10 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. PYTHONFAULTHANDLER=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
GPUS=$(nvidia-smi -L | wc -l)
TPS=$(for n in 2 4 8; do [ "$n" -le "$GPUS" ] && echo -n "$n "; done)
echo "# $GPUS GPUs; tensor parallel sizes $TPS"
source experiments/gpu_step.sh
first_tokens() {   # each prefill JSON's prompt first tokens, to set TP sizes side by side
  python3 -c 'import json, sys
for f in sys.argv[1:]:
    print("# first token", f, [r.get("first_token", r.get("error", "")[:60]) for r in json.load(open(f))["rows"]])' "$@"
}
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
  8)
    for n in 1 $TPS; do
      [ "$n" -gt 4 ] && continue
      step "decode-8bit-llama3-8b-tp$n" 200 python3 bench/decode.py --shapes llama3-8b --long --paths pallas \
           --quantization int8 fp8 --tensor-parallel-size "$n" --out "$OUT"
      mv "$OUT/decode.json" "$OUT/decode-8bit-llama3-8b-tp$n.json" 2>/dev/null
    done
    ;;
  4)
    for n in 1 $TPS; do
      [ "$n" -gt 4 ] && continue
      step "batch64-llama3-8b-tp$n" 170 python3 bench/throughput.py --shape llama3-8b --batches 64 --context 1024 \
           --decode-only --lazy-compile --tensor-parallel-size "$n" --out "$OUT"
      mv "$OUT/throughput.json" "$OUT/throughput-llama3-8b-tp$n.json" 2>/dev/null
    done
    ;;
  5)
    for n in 1 $TPS; do
      [ "$n" -gt 4 ] && continue
      step "prefill8k-llama3-8b-tp$n" 150 python3 bench/prefill.py --shapes llama3-8b --prompts 8192 --paths pallas \
           --tensor-parallel-size "$n" --out "$OUT"
      mv "$OUT/prefill.json" "$OUT/prefill-llama3-8b-tp$n.json" 2>/dev/null
    done
    first_tokens "$OUT"/prefill-llama3-8b-tp*.json
    ;;
  6|7)
    part=$1 shape=llama3-70b
    [ "$GPUS" -lt 4 ] && shape=llama3-70b@40
    shift
    for n in ${@:-$TPS}; do
      if [ "$part" = 6 ]; then
        step "batch64-70b-tp$n" 280 python3 bench/throughput.py --shape "$shape" --batches 64 --context 1024 \
             --decode-only --lazy-compile --tensor-parallel-size "$n" --out "$OUT"
        mv "$OUT/throughput.json" "$OUT/throughput-70b-tp$n.json" 2>/dev/null
      else
        step "prefill8k-70b-tp$n" 280 python3 bench/prefill.py --shapes "$shape" --prompts 8192 --paths pallas \
             --tensor-parallel-size "$n" --out "$OUT"
        mv "$OUT/prefill.json" "$OUT/prefill-70b-tp$n.json" 2>/dev/null
      fi
    done
    if [ "$part" = 7 ]; then first_tokens "$OUT"/prefill-70b-tp*.json; fi
    ;;
esac
