"""The kernels' tunable configs and every measured table, in one place.

A kernel reads its table from here when a step is traced (`tables.NAME`, looked up at call time, so a
bench or a test that patches a table here reaches the kernel). The executable cache hashes every
upper-case name of this module into its keys (runner/executable_cache.py), so a table changed at run
time never loads a step compiled under another. The tables were measured on one H200 by the sweeps in
bench/kernels/; a row's comment gives its time where that is what chose it.
"""

from __future__ import annotations

import dataclasses

_BIG = 1 << 62


# --- decode attention (decode_attention.py, decode_attention_rope.py) -------------------------------------------

@dataclasses.dataclass(frozen=True)
class SplitConfig:
    num_splits: int = 1   # programs per (sequence, KV head); power of two
    block_k: int = 64     # positions per inner step; power of two >= 16
    num_warps: int = 4
    num_stages: int = 2   # Triton software pipelining of the block loop
    merge: str = "pallas"  # "pallas" (kernel 2) or "jnp" (XLA reduction); unused with one split

    def astuple(self):
        return dataclasses.astuple(self)


# bench/kernels/decode_attention.py --sweep, H200, 2026-11-29, bf16, KVH 8, hd 128, page 16. Rows (max
# sequence-heads = batch x KVH, max span, config), first match wins; span = P * page_size, the longest context the
# page table can hold. The rule the sweep found: about 256-512 programs in all (B x KVH x num_splits), one or two
# blocks per split on short spans; num_warps 4 and num_stages 2 best or within noise everywhere.
DECODE_ATTENTION: list[tuple[int, int, SplitConfig]] = [
    (8, 128, SplitConfig(1, 64)),        # batch 1: ctx 100 4.1 us (2 splits: 6.9)
    (8, 1024, SplitConfig(16, 64)),      # ctx 1,024 6.4 us
    (8, _BIG, SplitConfig(64, 64)),      # ctx 8,192 13.9 us, 32,768 39.4 us (77% of 4.50 TB/s)
    (32, 128, SplitConfig(1, 64)),
    (32, 1024, SplitConfig(16, 64)),     # batch 4: ctx 1,024 10.1 us
    (32, _BIG, SplitConfig(8, 128)),     # batch 4: ctx 8,192 39.4 us, 32,768 135 us (91%)
    (64, _BIG, SplitConfig(8, 64)),      # batch 5-8, RoPE-fused kernel (bench/kernels/decode_attention_rope.py,
                                         # 2026-11-30): B8 ctx 1,024 13.9 us against 4x64's 15.8
    (128, 128, SplitConfig(1, 64)),
    (128, 1024, SplitConfig(8, 64)),     # batch 16: ctx 1,024 23.3 us
    (128, _BIG, SplitConfig(4, 64)),     # batch 16: ctx 8,192 131 us, 32,768 505 us (95%)
    (256, 128, SplitConfig(1, 64)),
    (256, _BIG, SplitConfig(2, 64)),     # batch 17-32, by the rule (not swept); checked at batch 32
    (_BIG, _BIG, SplitConfig(1, 64)),    # batch 64: ctx 100 11.7 us, 1,024 67 us, 8,192 509 us, 32,768 1.98 ms
]

# Float8 pages: bench/kernels/decode_attention.py --kv-cache-dtype fp8 --sweep, H200, 2026-11-29. Not bound by HBM
# reads: bf16 products ran as long as bf16 pages; rows marked f16 were swept with float16 products
# (page_compute_dtype), the others with bf16 products; rows where no point was swept keep bf16's config.
DECODE_ATTENTION_FP8: list[tuple[int, int, SplitConfig]] = [
    (8, 128, SplitConfig(1, 64)),
    (8, 1024, SplitConfig(16, 64)),                                  # batch 1: ctx 1,024 5.9 us
    (8, _BIG, SplitConfig(32, 128)),                                 # f16: ctx 8,192 12.6 us
    (32, 128, SplitConfig(1, 64)),
    (32, 1024, SplitConfig(16, 64)),
    (32, _BIG, SplitConfig(32, 128, num_stages=3)),                  # batch 4: ctx 8,192 37.8 us
    (128, 128, SplitConfig(1, 64)),
    (128, 1024, SplitConfig(2, 128, num_stages=3)),                  # batch 16: ctx 1,024 20.5 us
    (128, _BIG, SplitConfig(4, 128, num_stages=3)),                  # as batch 64 at 8,192 (not swept)
    (256, 128, SplitConfig(1, 64)),
    (256, _BIG, SplitConfig(2, 128, num_stages=3)),                  # as batch 16 (not swept)
    (512, _BIG, SplitConfig(1, 128, num_stages=3)),                  # f16: batch 64, ctx 1,024 52.7 us
    (_BIG, _BIG, SplitConfig(1, 64, num_warps=2, num_stages=3)),     # f16: batch 128, ctx 1,024 88.0 us
]


# --- speculative verify attention (verify_attention.py) ---------------------------------------------------------

# bench/kernels/verify_attention.py --sweep, H200, 2026-12-03 (PYTHONPATH=. python3 bench/kernels/verify_attention.py
# --sweep --no-table --budget 300): Qwen3-4B's heads (H 32, KVH 8, hd 128, groups of 4), bf16 pages of 16, Q 4, 8, 16
# (16-, 32-, 64-row tiles) x batch 1, 8 x ctx 1k, 8k, 32k. Rows (max tile rows M = Q x group padded to a power of
# two >= 16, max sequence-heads = batch x KVH, max span, config), first match wins. Comments: the time at a measured
# point, and the config before it as splits x block_k (reasoned: decode's splits, block_k 64, 8 warps from 64 rows).
# The rule the sweep found: on long spans about 512 programs (B x KVH x splits) at 16 rows, 256 at 32-64 rows; four
# warps everywhere (64-row tiles too); block_k and stages vary with rows. Rows marked interpolated were not swept:
# batch 2-4 and 9+ keep the nearest measured batch's block_k and stages with splits scaled to its programs; spans
# <= 128 keep one split, as decode measured. The jnp merge won by 0.3-2.6% at four points and lost elsewhere: the
# Pallas merge is kept (it reads only the splits that had positions; jnp's reads all of them, however long the span).
_VERIFY_16: list[tuple[int, int, SplitConfig]] = [   # Q x group <= 16 (Q 4 at groups of 4)
    (8, 128, SplitConfig(1, 64)),
    (8, 1024, SplitConfig(32, 32)),         # B1 ctx 1k 6.27 us (was 16x64: 7.33; jnp merge 6.11)
    (8, _BIG, SplitConfig(64, 64)),         # B1 ctx 8k 14.59, 32k 40.09 (as before; 2 warps at 32k 39.36)
    (32, 128, SplitConfig(1, 64)),
    (32, _BIG, SplitConfig(16, 64)),        # interpolated
    (64, _BIG, SplitConfig(8, 64)),         # B8 ctx 1k 14.52, 8k 69.40, 32k 251.1 (as before; all within 1.8%)
    (128, 128, SplitConfig(1, 64)),
    (128, _BIG, SplitConfig(4, 64)),        # interpolated
    (256, _BIG, SplitConfig(2, 64)),        # interpolated
    (_BIG, _BIG, SplitConfig(1, 64)),
]
_VERIFY_32: list[tuple[int, int, SplitConfig]] = [   # 17-32 rows (Q 8 at groups of 4)
    (8, 128, SplitConfig(1, 64)),
    (8, 1024, SplitConfig(16, 64, num_stages=3)),     # B1 ctx 1k 7.00 (was 16x64/s2: 7.23; 8 warps 6.99)
    (8, 8192, SplitConfig(32, 64, num_stages=3)),     # B1 ctx 8k 15.18 (was 64x64: 19.92; 32x128 17.79)
    (8, _BIG, SplitConfig(32, 128)),                  # B1 ctx 32k 43.15 (was 64x64: 52.62)
    (32, 128, SplitConfig(1, 64)),
    (32, 1024, SplitConfig(8, 64, num_stages=3)),     # interpolated
    (32, _BIG, SplitConfig(8, 128)),                  # interpolated
    (64, 1024, SplitConfig(4, 64, num_stages=3)),     # B8 ctx 1k 16.00 (was 8x64: 20.88)
    (64, _BIG, SplitConfig(4, 128)),                  # B8 ctx 8k 74.84 (was 8x64: 96.80), 32k 261.6 (was 348.0)
    (128, 128, SplitConfig(1, 64)),
    (128, 1024, SplitConfig(2, 64, num_stages=3)),    # interpolated
    (128, _BIG, SplitConfig(2, 128)),                 # interpolated
    (256, _BIG, SplitConfig(2, 128)),                 # interpolated
    (_BIG, _BIG, SplitConfig(1, 128)),                # interpolated
]
_VERIFY_64: list[tuple[int, int, SplitConfig]] = [   # 33-64 rows (Q 16 at groups of 4)
    (8, 128, SplitConfig(1, 64)),
    (8, 1024, SplitConfig(16, 64)),                   # B1 ctx 1k 7.73 (was 16x64/w8: 8.10)
    (8, 8192, SplitConfig(16, 128, num_stages=3)),    # B1 ctx 8k 16.06 (was 64x64/w8: 25.33; 32x64 18.51)
    (8, _BIG, SplitConfig(32, 64)),                   # B1 ctx 32k 46.94 (was 64x64/w8: 62.74)
    (32, 128, SplitConfig(1, 64)),
    (32, 1024, SplitConfig(4, 64)),                   # interpolated
    (32, _BIG, SplitConfig(8, 64)),                   # interpolated
    (64, 1024, SplitConfig(2, 128, num_stages=3)),    # B8 ctx 1k 18.43 (was 8x64/w8: 26.39; 4x64 20.30)
    (64, _BIG, SplitConfig(4, 64)),                   # B8 ctx 8k 83.55 (was 8x64/w8: 109.9), 32k 290.0 (was 396.5)
    (128, 128, SplitConfig(1, 64)),
    (128, 1024, SplitConfig(1, 128, num_stages=3)),   # interpolated
    (128, _BIG, SplitConfig(2, 64)),                  # interpolated
    (_BIG, _BIG, SplitConfig(1, 64)),
]
# 65-128 rows (Q 16 at groups of 8): NOT MEASURED, still the initial values by reasoning (the sweep ran groups of 4
# only; --heads 64:8 reaches these tiles): decode's splits (about 256-512 programs), block_k 64, eight warps. ptxas
# for sm_90 (triton 3.6 on the CPU, bench/kernel_registers.py's way; hd 128, 64-key blocks) gives 254 registers a
# thread at M = 128 with four warps, 128 with eight (at M = 64 144 with four, yet four won at every point above).
_VERIFY_SPLITS: list[tuple[int, int, SplitConfig]] = [
    (8, 128, SplitConfig(1, 64)),
    (8, 1024, SplitConfig(16, 64)),
    (8, _BIG, SplitConfig(64, 64)),
    (32, 128, SplitConfig(1, 64)),
    (32, 1024, SplitConfig(16, 64)),
    (32, _BIG, SplitConfig(8, 64)),
    (64, _BIG, SplitConfig(8, 64)),
    (128, 128, SplitConfig(1, 64)),
    (128, 1024, SplitConfig(8, 64)),
    (128, _BIG, SplitConfig(4, 64)),
    (256, _BIG, SplitConfig(2, 64)),
    (_BIG, _BIG, SplitConfig(1, 64)),
]
VERIFY_ATTENTION: list[tuple[int, int, int, SplitConfig]] = (
    [(16, sh, span, c) for sh, span, c in _VERIFY_16]
    + [(32, sh, span, c) for sh, span, c in _VERIFY_32]
    + [(64, sh, span, c) for sh, span, c in _VERIFY_64]
    + [(128, sh, span, dataclasses.replace(c, num_warps=8)) for sh, span, c in _VERIFY_SPLITS])


# --- batch-1 decode GEMVs (fused_gemv.py) -----------------------------------------------------------------------

# Columns a program's tile spans, by (out, in) of a 2-byte matrix (4-byte weights: 128; absent: the default).
# The GEMV sweep, H200, 2026-11-29, bf16, T=1 (one warp and one row a program won almost everywhere).
GEMV_BLOCK_IN: dict[tuple[int, int], int] = {
    (6144, 2560): 128,      # Qwen3-4B qkv
    (19456, 2560): 512,     # Qwen3-4B gate/up
    (2560, 9728): 128,      # Qwen3-4B down
    (2560, 4096): 128,      # Qwen3-4B o_proj (256: 98 registers, two waves; 128: ~64, one wave)
    (4096, 4096): 128,      # Llama-3-8B o_proj
    (28672, 4096): 512,     # Llama-3-8B gate/up
    (4096, 14336): 256,     # Llama-3-8B down
    (151936, 2560): 256,    # Qwen3-4B lm_head
    (5120, 2048): 128,      # Qwen3-30B-A3B qkv: its batch-1 step at @8 0.725 / 0.723 ms against 256's 0.730 / 0.734
                            # (H100, 2026-12-05 and -06, one process a variant; 512 0.722 / 0.732, o_proj 128 level)
}
GEMV_DEFAULT_BLOCK_IN = 256   # within 2% of the best at 5 of the 8 shapes, 16-35% behind at the others

# Output rows a program at batch 1 by (output rows, in); absent: GEMV_DEFAULT_ROWS. Several rows a program share
# the x and norm-scale loads (bench/kernels/fused_gemv.py, H200, 2026-11-30: Qwen3-4B's QKV 10.87 us at 1 row,
# 9.71 at 2; o_proj, gate/up and down slower at 2). Only rows a whole decode step confirmed.
GEMV_ROWS: dict[tuple[int, int], int] = {(6144, 2560): 2,    # Qwen3-4B's QKV
                                         (6144, 4096): 2}    # Llama-3-8B's QKV
GEMV_DEFAULT_ROWS = 1

# The same for 1-byte weights (int8, float8_e4m3fn: fused_gemv's w_scale), keyed as the 2-byte tables are read
# (ops.pallas._gemv: SwiGLU's gate rows, so the [19456, 2560] gate/up matrix is (9728, 2560)). Measured for int8:
# `PYTHONPATH=. python3 bench/kernels/quantized_gemv.py --shapes qwen3-4b --formats int8 [--sweep]`, H200, jax
# 0.11.2, 2026-12-03 (bench/results/2026-12-03-quant-h200-gemv-{defaults,sweep}.json; block_in 256/512/1024 x rows
# 1/2 x bits/cvt, one warp). Per projection, us a call: the old defaults (512, 1 row, bits) -> the best config here
# (bf16 at its table):
#   qkv     6144x2560    10.37 -> 8.41   (256, 2 rows, cvt; bf16 9.64)
#   o_proj  2560x4096    11.57 -> 7.22   (512, 1 row, bits: the old default, 7.22 again in the sweep; bf16 6.92-9.53)
#   gate/up 19456x2560   22.71 -> 19.63  (256, 1 row, cvt; bf16 26.0)
#   down    2560x9728    12.11 -> 10.47  (512, 1 row, cvt; 256/bits 10.49; bf16 13.4)
#   lm_head 151936x2560  120.5 -> 108.2  (256, 2 rows, cvt; bf16 176.0)
# A layer's four: 56.8 -> 45.7 us (bf16 56.0 and 58.5 in the two runs); 32-80% of the int8 HBM read ceiling. o_proj
# ran bimodal (bf16 6.92 and 9.53 at one config in the two runs; int8 7.2-7.6 or 9.8-11.0 across the sweep).
# A second sweep the same day with the byte-permute conversion ("prmt") and rows 1/2/4/8 (block_in 256/512, cvt/prmt;
# bench/results/2026-12-03-quant-h200-gemv-prmt.log), best: qkv 8.10 (512, 8 rows, prmt; kept 256/2/cvt, 8.83 here
# and 8.41 before: rows 8 lost badly at every other shape), o_proj 7.42 (256, 2, prmt), gate/up 18.75 (256, 2, prmt),
# down 9.61 (512, 1, prmt), lm_head 95.6 (256, 4 rows, prmt; 89.6% of its ceiling). A layer 43.9 us (bf16 56.0).
# 2026-12-05 (H100; bench/results/2026-12-05-h100-2-{p21,gemv-warps,int8ab,int8ab2}-*): Nsight Compute put o_proj's
# int8 GEMV (2 rows a program: 1,280 one-warp programs) at 0.3 waves and 38% of DRAM, gate/up's (4,864 programs at 84
# registers, 20 an SM) at 1.84 waves; a sweep of block_in 256/512/1024 x rows 1/2/4 x warps 1/2/4 (prmt) took o_proj
# to 1024 columns and one row (6.45 us), gate/up to one row (21.0 us), down to 256 columns (11.0 us); more warps a
# program lost at every shape. The whole step (Qwen3-4B, batch 1, one process a table, table / these / table, twice):
# 2.181 / 2.142 / 2.186 ms, then 2.149 (these) / 2.183: -1.7%, the table below since.
# Float8 weights read the same tables (keyed by shape; not measured on their own). Block-scaled weights clamp
# block_in to the scale block's columns.
# 2026-12-06 (H100; bench/results/2026-12-06-h100-p26-*): Llama-3-8B's shapes, which had no rows (512 columns, one
# row, cvt), swept the same way (rows 1/2/4 x block_in 256/512/1024 x cvt/prmt, one warp), us a call: QKV 11.54 (256,
# 2 rows, prmt), o_proj 7.99 (256, 2, prmt), gate/up 43.58 (256, 1, prmt), down 21.97 (512, 1, prmt), lm_head 171.37
# (1024, 1, cvt); a layer's four 85.1 us (81.3% of the int8 ceiling; bf16 151.9). The whole step (Llama-3-8B, batch
# 1, 1k, one process each): 3.721 ms on the old defaults -> 3.196 on these (-14%; 1.48x -> 1.72x bf16's 5.51).
GEMV_BLOCK_IN_8BIT: dict[tuple[int, int], int] = {(6144, 2560): 256, (2560, 4096): 1024, (9728, 2560): 256,
                                                  (2560, 9728): 256, (151936, 2560): 256,
                                                  (6144, 4096): 256, (4096, 4096): 256, (14336, 4096): 256,
                                                  (4096, 14336): 512, (128256, 4096): 1024}
# The default for shapes never swept: one block_in for every product of a layer, summed over its four GEMVs (the two
# H100 sweeps above, one row a program): Llama-3-8B 256/cvt 88.95 us, 512/cvt 100.8, 512/prmt 96.1; Qwen3-4B (prmt
# only) 256 48.1, 512 52.3. 256 columns (each lane one 8-byte load a row a tile) beat 512 on both models' layers and
# tied at the lm_heads (172.6 against 172.6 us, 130.1 against 129.6).
GEMV_DEFAULT_BLOCK_IN_8BIT = 256
GEMV_ROWS_8BIT: dict[tuple[int, int], int] = {(6144, 2560): 2, (151936, 2560): 4, (6144, 4096): 2, (4096, 4096): 2}
GEMV_WARPS_8BIT: dict[tuple[int, int], int] = {}   # warps a program (absent: 1; the sweeps above ran one warp only)
# How the GEMV turns int8 into float32 (fused_gemv.weights_to_f32; all exact): "cvt" (I2F, a quarter of the FMA
# rate: at 4.5 TB/s of int8 about what 132 SMs convert), "bits" (integer logic and a float add at full rate) or "prmt"
# (one byte permute a value, inline PTX). In the first sweep cvt beat bits at 20 of the 30 (shape, block_in, rows)
# pairs, so it is the default (the batched skinny GEMM reads the default too: exact either way); by shape where
# measured, prmt at four of the five shapes in the second.
GEMV_INT8_CONVERT = "cvt"
GEMV_INT8_CONVERT_BY_SHAPE: dict[tuple[int, int], str] = {(6144, 2560): "cvt", (2560, 4096): "prmt",
                                                          (9728, 2560): "prmt", (2560, 9728): "prmt",
                                                          (151936, 2560): "prmt",
                                                          (6144, 4096): "prmt", (4096, 4096): "prmt",
                                                          (14336, 4096): "prmt", (4096, 14336): "prmt",
                                                          (128256, 4096): "cvt"}


# --- batch-1 mixture of experts (moe_gemv.py) ------------------------------------------------------------------

# (rows a program, block_in) of the routed GEMVs by epilogue (fewer rows where these do not divide the outputs).
# H200, jax 0.11.2, 2026-12-04 (bench/kernels/moe.py --tokens 1; ms a call):
#   Qwen3-30B-A3B, chained over 8 layers: gate/up 4/256 0.017 (2/256 0.021, 1/256 0.019; a dense GEMV of its bytes
#     0.018); combine 1/256 0.014, 1/512 0.013, 2/256 0.015, 2/512 0.014: within noise;
#   Mixtral-8x7B, one call a jit: gate/up 4/256 0.116 (= 1/256; 2/256 0.132); combine 1/256 0.059 (2/512 0.091).
# Two warps lost everywhere. Whole steps against the first guess (2/256 and 2/512), batch 1 after 1k:
# Qwen3-30B-A3B@24 1.644 -> 1.468 ms, Mixtral-8x7B@8 2.176 -> 1.782 ms (bench/decode.py). In-step A/B at
# Qwen3-30B-A3B@8 (experiments/with_tables.py, each its own process): these 0.615 ms, gate/up 8 rows 0.661, combine
# 2 rows 0.640.
ROUTED_GEMV: dict[str, tuple[int, int]] = {"swiglu": (4, 256), "combine": (1, 256)}


# --- a mixture of experts' rows on the Triton grouped GEMM (grouped_gemm.py) -------------------------------------

@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
    block_m: int = 64     # rows an item holds at most (a power of two >= 16: tensor-core tiles)
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


# Batched-decode rows, bf16 experts: (experts, N, K, epilogue) -> ((first assignments, last assignments, config),
# ...), assignments = tokens x top_k; both products of a block need a row with one block_m (one item schedule).
# Kernels (H100, 2026-12-06, bench/kernels/moe.py --tokens 32 64, bench/results/2026-12-06-h100-4/p34-*; ms a call,
# gate/up + down at one block_m) against choose_config's split-K pair: Qwen3-30B-A3B at 32 / 64 tokens 0.517 / 0.606
# against 0.665 / 0.692; Mixtral-8x7B 1.014 / 1.020 against 1.092 / 1.160 (split K lost at every point). Whole
# steps, batch 64 at 1k (bench/throughput.py, this table against it emptied, one process each; p40*, p41*): Mixtral-
# 8x7B@8 device step 10.385 -> 9.348 ms, full-batch end to end 12.258 -> 10.964; Qwen3-30B-A3B@24 14.685 / 14.740 ->
# 14.380 / 14.387 (two pairs; -2%). From 128 tokens the grouped Mosaic GEMM takes the rows (HOPPER_GROUPED_GEMM;
# from 32 tokens it lost in the step: its padded layout); below 32 tokens choose_config's rule (not measured).
GROUPED_GEMM: dict[tuple[int, int, int, str], tuple[tuple[int, int, GroupedGemmConfig], ...]] = {
    # Qwen3-30B-A3B: 128 experts of 768, 8 active; 32-127 tokens
    (128, 1536, 2048, "swiglu"): ((256, 1023, GroupedGemmConfig(32, 64, 64, 4, 3)),),
    (128, 2048, 768, "none"): ((256, 1023, GroupedGemmConfig(32, 128, 64, 4, 3)),),
    # Mixtral-8x7B: 8 experts of 14,336, 2 active; 32-127 tokens
    (8, 28672, 4096, "swiglu"): ((64, 255, GroupedGemmConfig(64, 64, 64, 4, 3)),),
    (8, 4096, 14336, "none"): ((64, 255, GroupedGemmConfig(64, 128, 64, 8, 3)),),
}


# --- batched-decode GEMM (skinny_gemm.py) -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    # 8-bit weights only: W8A8, each row of x quantized to the weights' format (its own scale) and the tile products
    # on 8-bit tensor cores (fp8 e4m3 or int8), instead of the weight tiles converted to x's dtype
    w8a8: bool = False


# bench/kernels/skinny_gemm.py --sweep, H200, 2026-11-29, bf16: the best config per (N, K, epilogue) at M = 16 (used
# for M <= 16) and M = 64 (16 < M <= 64), kept only where it beat XLA's GEMM in the same run. Missing: XLA is as
# fast or faster (gate/up at M = 64), or the shape was not swept.
SKINNY_GEMM: dict[tuple[int, int, str, int], SkinnyConfig] = {
    (6144, 2560, "none", 16): SkinnyConfig(64, 256, 8, 4, 1),       # 10.95 us vs XLA 11.80
    (6144, 2560, "none", 64): SkinnyConfig(64, 128, 4, 6, 1),       # 10.79 vs 14.50
    (2560, 4096, "residual", 16): SkinnyConfig(128, 128, 4, 4, 4),  # 9.66 vs 13.99
    (2560, 4096, "residual", 64): SkinnyConfig(128, 128, 4, 4, 4),  # 10.03 vs 11.26
    (19456, 2560, "swiglu", 16): SkinnyConfig(32, 128, 4, 3, 1),    # 26.59 vs 27.99
    (2560, 9728, "residual", 16): SkinnyConfig(32, 64, 4, 4, 8),    # 16.21 vs 16.49
    (2560, 9728, "residual", 64): SkinnyConfig(128, 128, 4, 4, 4),  # 17.94 vs 19.27
}

# The same for 1-byte weights (skinny_gemm's w_scale), kept where the kernel beat XLA's products (the converted
# values, reference.quantized_product, or fp8 W8A8) by 3%, in a whole step. Kernels alone (H100, 2026-12-05, `bench/
# kernels/quantized_gemv.py --no-gemv --batched 64 --batched-sweep`): only gate/up's W8A8 tiles beat XLA at 64 rows
# (24.8 / 23.4 us against 30.8 / 29.4, int8 / fp8); the whole-step A/B is experiments/gpu_round_next.sh 23. Until
# then batched decode steps with 8-bit weights take XLA's GEMM.
SKINNY_GEMM_8BIT: dict[tuple[int, int, str, int], SkinnyConfig] = {}

# Rows from which XLA's product with fp8 per-channel weights runs as W8A8 on fp8 tensor cores (ops.pallas.w8a8_product:
# each row of x quantized to e4m3 with its own scale), None: never (the values converted to bf16 instead). It takes
# the products HOPPER_GEMM_8BIT and SKINNY_GEMM_8BIT do not (at 1k / 8k prompt rows o_proj and down; every product at
# other row counts and at batch 64). Qwen3-4B on the H100 (2026-12-06, one process a variant, against bf16 in the
# same process): prefill 1k 1.16x / 1.17x and 8k 1.16x / 1.19x with it, against 1.04x / 1.08x with the converted
# values; batch 64 at 1k 1.13x against 1.10x. The fewest rows measured; 16-row products lost (2026-12-03). A model's
# steps of this many rows or more compile without XLA's Triton GEMM fusions, its smaller ones with them (their
# converted values fused into the GEMM: runner/compiler_options.py).
FP8_W8A8_ROWS: int | None = 64

# The same for int8 per-channel weights on int8 tensor cores (ops.pallas.int8_w8a8_product: each row of x quantized
# to int8 with its own scale, the sums exact in int32), None: never (the values converted to bf16 in XLA's GEMM
# fusion instead). Not yet measured (gpu_round_next.sh 10); its quality is bench/quality.py's "int8 W8A8" row.
INT8_W8A8_ROWS: int | None = None

# A mixture of experts' rows (T x top_k expert assignments) from which 8-bit experts with per-channel scales run the
# grouped GEMM in W8A8 (grouped_gemm's x_scale: each row quantized to the experts' format, 8-bit tile products),
# either format; None: never (the expert tiles converted to the activations' dtype in registers). Not yet measured
# (gpu_round_next.sh 17, 18).
GROUPED_W8A8_ROWS: int | None = None

# W8A8's activation rows (the skinny, Mosaic and grouped GEMMs' x_scale) quantized by one kernel
# (pallas/row_quantize.py, the RMSNorm before it folded in) instead of XLA's norm and two passes. Not yet measured
# (gpu_round_next.sh 15 traces the batch-64 step's kernels; an in-step A/B: experiments/with_tables.py
# ROW_QUANTIZE_KERNEL=True).
ROW_QUANTIZE_KERNEL: bool = False


# --- prompt-row GEMM on Hopper (hopper_gemm.py) -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HopperConfig:
    tile_m: int = 64        # rows per compute warpgroup (the CTA takes 2 x tile_m)
    tile_n: int = 128       # output columns per CTA (swiglu: gate and up columns each)
    tile_k: int = 64        # 64 bf16 = one 128-byte swizzled row
    stages: int = 4         # shared-memory ring depth
    epi_n: int = 64         # epilogue tile columns (rows: tile_m)
    snake_width: int = 8    # planar snake: tiles of this many along M before moving along N


# Prompt-row products where the kernel made the 1k prompt step faster than XLA's GEMM (cuBLAS) with the epilogue in
# XLA (bench/kernels/hopper_gemm.py and the step, H200, 2026-12-01, Qwen3-4B's shapes; the kernel bench alone
# misleads: cuBLAS ran QKV in 44 us in the step's trace and 67 us in the bench). Absent: XLA's GEMM.
# (N, K, epilogue) -> ((first rows, last rows, config), ...)
HOPPER_GEMM: dict[tuple[int, int, str], tuple[tuple[int, int, HopperConfig], ...]] = {
    (6144, 2560, "none"): ((1024, 1024, HopperConfig(64, 192, 64, 4)),),      # QKV 1k: 44.5 us (64x128/5: 49.3)
    (19456, 2560, "swiglu"): ((1024, 1024, HopperConfig(64, 128, 64, 3)),     # gate/up 1k: 151.6 (128x64/3: 155.2)
                              (8192, 8192, HopperConfig(64, 128, 64, 3))),    # 8k: 1196 vs XLA 1280
}

# The same kernel in W8A8 (x's rows quantized to the weights' format, 8-bit tensor cores, the scales in the epilogue)
# for 8-bit weights with a scale per output channel, keyed by the format too ("fp8" / "int8": W8A8 changes what a
# prompt step computes, so a format runs it only where its own whole step was measured): the rows where it beat
# XLA's product of the same weights (FP8_W8A8_ROWS / INT8_W8A8_ROWS, or the converted values) in the step. tile_k
# counts elements (128: one 128-byte row). fp8 (experiments/gpu_round_next.sh 16, H100, 2026-12-05; logs
# bench/results/2026-12-05-h100-2-p16-*): the sweep's winners against XLA's fp8 W8A8, the outputs the bits of the
# float32-summing twin; us, kernel / XLA fp8 W8A8 / XLA bf16: QKV 1k 29.3 / 52.2 / 74.5, 8k 222.6 / 289.6 / 340.8;
# gate/up 1k 107.7 / 117.5 / 161.5, 8k 806.4 / 820.4 / 1214.8. o_proj and down lost to XLA's W8A8 (35.4 against 31.4
# at 1k, 71.7 against 64.0) and stay on the converted values. With these rows the fp8 prefill ran 1.04x bf16's at
# 1k and 1.08x at 8k (bench/prefill.py, one process; 0.81x / 0.85x on the converted values alone). int8
# (gpu_round_next.sh 19, H100, 2026-12-06; bench/results/2026-12-06-h100-p19-*): every output the bits of XLA's exact
# s8 x s8 -> s32 product; us, kernel / XLA int8 W8A8 / XLA bf16: QKV 1k 27.7 / 56.0 / 75.0, 8k 198.3 / 393.5 / 346.6;
# o_proj 8k 169.9 / 238.4 / 275.6; gate/up 1k 92.4 / 173.6 / 162.5, 8k 696.8 / 1276.2 / 1236.0; down 1k 68.7 / 69.2
# / 102.2, 8k 364.2 / 413.9 / 567.7 (o_proj 1k lost to XLA's W8A8, 34.3 against 33.8, and was left out of the step).
# With these rows the int8 prefill ran 1.10x bf16's at 1k (13.1 against 14.4 ms) and 1.27x at 8k (101.3 against
# 128.2), one process; the rest on the converted values.
HOPPER_GEMM_8BIT: dict[tuple[int, int, str, str], tuple[tuple[int, int, HopperConfig], ...]] = {
    (6144, 2560, "none", "fp8"): ((1024, 1024, HopperConfig(64, 192, 128, 4)),
                                  (8192, 8192, HopperConfig(64, 192, 128, 4))),
    (19456, 2560, "swiglu", "fp8"): ((1024, 1024, HopperConfig(64, 64, 128, 4)),
                                     (8192, 8192, HopperConfig(64, 64, 128, 4))),
    (6144, 2560, "none", "int8"): ((1024, 1024, HopperConfig(64, 192, 128, 4)),
                                   (8192, 8192, HopperConfig(64, 192, 128, 4))),
    (2560, 4096, "residual", "int8"): ((8192, 8192, HopperConfig(64, 128, 128, 4)),),
    (19456, 2560, "swiglu", "int8"): ((1024, 1024, HopperConfig(64, 64, 128, 5)),
                                      (8192, 8192, HopperConfig(64, 64, 128, 5))),
    (2560, 9728, "residual", "int8"): ((1024, 1024, HopperConfig(64, 128, 128, 4)),
                                       (8192, 8192, HopperConfig(64, 128, 128, 4))),
}

# A mixture of experts' prompt rows on the grouped Mosaic GPU GEMM (hopper_gemm's row_tile_group; the rows sorted by
# expert and padded to whole CTA tiles, pallas/expert_tiles.py) in place of the Triton grouped GEMM, bf16 experts:
# (experts, N, K, epilogue) -> ((first assignments, last assignments, config), ...), assignments = tokens x top_k.
# Both products of a block (gate/up + SwiGLU, down) need a row for the block to take it, with one CTA row tile.
# Measured (H100, 2026-12-06, bench/kernels/moe.py, bench/results/2026-12-06-h100-3/moe_*): the best config at 128,
# 1,024 and 8,192 tokens (Mixtral-8x7B) / 128, 1,024 and 4,096 (Qwen3-30B-A3B), against the Triton grouped GEMM's
# best: Mixtral gate/up 0.896 against 1.403 ms and down 0.495 against 0.768 at 1,024 tokens, both 1.7x at 8,192, a
# tie at 128; Qwen3-30B-A3B gate/up 0.327 against 0.439 and down 0.176 against 0.266 at 1,024, 2.1x / 2.2x at 4,096.
# Below 128 tokens (batched decode) the Triton GEMM keeps the rows (not measured). Qwen3-30B-A3B's last range
# reaches an 8,192-token prompt chunk (65,536 assignments), measured to 4,096 tokens: the sweep's XLA reference ran
# out of memory at 8,192.
HOPPER_GROUPED_GEMM: dict[tuple[int, int, int, str], tuple[tuple[int, int, HopperConfig], ...]] = {
    # Mixtral-8x7B: 8 experts of 14,336, 2 active
    (8, 28672, 4096, "swiglu"): ((256, 16384, HopperConfig(64, 128, 64, 4)),),
    (8, 4096, 14336, "none"): ((256, 16384, HopperConfig(64, 256, 64, 4)),),
    # Qwen3-30B-A3B: 128 experts of 768, 8 active
    (128, 1536, 2048, "swiglu"): ((1024, 8192, HopperConfig(64, 128, 64, 3)),
                                  (8193, 65536, HopperConfig(64, 128, 64, 4))),
    (128, 2048, 768, "none"): ((1024, 8192, HopperConfig(64, 128, 64, 4)),
                               (8193, 65536, HopperConfig(64, 256, 64, 4))),
}


# --- one fresh prompt's attention on Hopper (hopper_attention.py) -----------------------------------------------

@dataclasses.dataclass(frozen=True)
class FlashConfig:
    block_q: int = 64     # rows a compute warpgroup (wgmma's M: a multiple of 64); K/V blocks are 2 x block_q keys
    stages: int = 2       # K/V blocks in flight in the shared-memory ring
    # The two compute warpgroups take turns on the tensor cores (FA3's ping-pong): one's softmax runs while the
    # other's two products do, ordered by a barrier both arrive at twice a step, warpgroup 1 one phase behind.
    pingpong: bool = True
    # One CTA an SM walking work items (a query head's 2 x block_q rows) in a loop, its ring streaming the next
    # item's Q and K/V while the last item's softmax, products and output finish (False: one CTA an item).
    persistent: bool = True
    # Q buffers a warpgroup (persistent): with 2 the next item's Q is loaded while this one runs, not after its last
    # QK^T (then only a 1-deep K/V ring fits the shared memory at hd 128).
    q_buffers: int = 1

    @property
    def block_kv(self) -> int:
        return 2 * self.block_q


# Prompt lengths (first, last tokens) where the kernel ran faster than cuDNN's flash attention; elsewhere cuDNN.
# bench/kernels/hopper_attention.py, H200, Qwen3-4B's heads, 2026-12-02: 1k 27.8 us against cuDNN's 42.1, 2k 80.7
# against 99.6, 8k 1046 against 1039 (level: cuDNN kept).
FRESH_PROMPT_FLASH: list[tuple[int, int, FlashConfig]] = [(1024, 2048, FlashConfig())]


# --- prompt attention over the paged cache (prefill_attention.py) -----------------------------------------------

@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    block_q: int = 32      # query tokens per program; power of two
    block_k: int = 64      # key positions per inner step; power of two >= 16
    heads: int = 0         # query heads per program: 0 = the whole GQA group (K/V tiles shared by the
                           # group); else a divisor of the group (1: one head per program, the
                           # "short prompt" variant with more, smaller programs)
    num_warps: int = 4
    num_stages: int = 2    # Triton software pipelining of the key loop
    order: str = "work"    # schedule order: "work" (most keys first) or "natural" (sequence, block)

    def astuple(self):
        return dataclasses.astuple(self)


# bench/kernels/prefill_attention.py --sweep, H200, 2026-11-29: rows (max tokens T of the call, tile rows, config),
# first match wins; the tile rows (block_q x the heads of a program, padded to a power of two) fix block_q for the
# model's group, so one row serves every GQA shape. Up to 256 tokens 16-row tiles of the whole group with 128-key
# blocks won (prompt 128: 6.1 us against 7.4 for one head a program); from 1k on, 128-row tiles were within 4% of
# the best of 48 configs everywhere. (128-key blocks at 4 stages pass the 227 KB of shared memory.)
PREFILL_ATTENTION: list[tuple[int, int, PrefillConfig]] = [
    (256, 16, PrefillConfig(block_k=128, heads=0, num_warps=4, num_stages=2)),
    (_BIG, 128, PrefillConfig(block_k=64, heads=0, num_warps=8, num_stages=3)),
]


# --- the prompt step's norm/RoPE/cache write (rope_kv_write.py) -------------------------------------------------

# A program's tokens as tiles of this many (a power of two): H200, the 1k prompt step 13.95 ms as a one-token loop,
# 13.85 at tiles of 8 (16: 13.92, 32: 14.14).
ROPE_KV_WRITE_TILE = 8

# --- the INT8 KV cache in the decode attention kernels (decode_attention.py, decode_attention_rope.py) ------------

# How int8 pages become the kernels' compute dtype (decode_attention.int8_to): "cvt", the conversion instruction (I2F
# runs at a quarter of the FMA rate on Hopper); "bits", exact integer adds into a float's low mantissa bits and one
# float subtraction; "prmt", byte permutes into float16 two values an instruction and one f16x2 subtraction a pair.
# H200, 2026-12-03, `bench/kernels/decode_attention_rope.py --points 1:32768 --kv-cache-dtype int8 --int8-convert
# C` (batch 1, 32,768 positions, best config / the table's; bf16 pages 38.26 us): cvt 37.08 / 38.35 us, bits 35.48 /
# 36.58, prmt 30.46 / 35.31 (prmt from a later machine start; logs bench/results/2026-12-03-kvint8-h200-kernel-*).
DECODE_ATTENTION_INT8_CONVERT = "prmt"

# Int8 pages' split table: the float8 one (1-byte pages), but batch 1 past 1,024 positions with 3 pipeline stages: at
# 32,768 positions with prmt, 32x128/w4/s3 30.46 us against the float8 row's s2 35.31 (the same sweep as above).
DECODE_ATTENTION_INT8: list[tuple[int, int, SplitConfig]] = [
    (sh, span, SplitConfig(32, 128, num_stages=3) if (sh, span) == (8, _BIG) else c)
    for sh, span, c in DECODE_ATTENTION_FP8]
