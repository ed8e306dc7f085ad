"""Every Pallas kernel lowers to Triton IR for an H200, on the CPU.

Interpret mode (the other kernel tests) runs a kernel's jaxpr with XLA's CPU ops, so it never meets
the Triton lowering's own limits: a kernel can pass every interpret test and fail to lower on the
GPU (2026-11-29: a scalar-bool `where` broadcast into an add lowered to `i1 + f32`). Here the
engine's compiled steps, each op set's, and the decode attention kernels at the real models' shapes
are lowered for the `cuda` platform with the GPU's description stubbed in (Pallas asks the device
for its compute capability; this machine has none). Lowering stops before ptxas, so a Triton
compile error can still surface only on the GPU; a lowering error cannot.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import gpu_info

from jaxinfer.model.config import load_config
from jaxinfer.model.transformer import split_layers
from jaxinfer.ops import get_ops
from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas.decode_attention_rope import decode_attention_rope_write
from bench.random_model import LLAMA3_8B, QWEN3_0_6B, QWEN3_4B, write_random_model
from jaxinfer.runner.model_runner import ModelRunner
from jaxinfer.settings import EngineConfig
from jaxinfer.model.weights import load_params


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))


TRITON_CALL = "custom_call @__gpu$xla.gpu.triton"   # how a lowered Pallas Triton kernel appears in the module
# Two scalars (a kernel's layer indices) joined into one int32[2]: on the GPU XLA makes a pair of constants a
# parameterless fusion that runs as a kernel every step (pallas/blocks.py, layer_operands)
LAYER_PAIR = re.compile(r"stablehlo\.concatenate [^\n]*\(tensor<1xi32>, tensor<1xi32>\) -> tensor<2xi32>")


def _lower(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# Head dim 128 and grouped queries, as the real models have, at a few MB of weights.
SMALL = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 512, "max_position_embeddings": 1024}


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def small_model(request, tmp_path_factory):
    base = QWEN3_0_6B if request.param == "qwen3" else LLAMA3_8B
    return write_random_model(tmp_path_factory.mktemp(request.param) / "m", {**base, **SMALL}, dtype="bfloat16")


@pytest.mark.parametrize("kv", [None, jnp.float8_e4m3fn], ids=["pallas", "pallas-fp8-kv"])
@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scanned"])
def test_engine_steps_lower(small_model, kv, unroll):
    cfg = load_config(small_model, "bfloat16")
    params = load_params(small_model, cfg, progress=False)
    # the one-sequence steps too (the fresh one's K/V from the write, or read back from float8)
    runner = _runner(cfg, split_layers(params) if unroll else params, kv, unroll_layers=unroll, decode_steps=2,
                     prefixed_chunk_attention=True)
    calls = runner.bucket_calls()
    assert len(calls) >= 6 and "mixed-greedy" in {v.name for v, _ in calls}
    assert {"mixed-fresh", "mixed-prefixed"} <= {v.name for v, _ in calls}
    for variant, batch in calls:
        traced = runner.steps[variant].trace(runner.params, runner.kv, runner.state, batch)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert TRITON_CALL in text
        assert not LAYER_PAIR.search(text), (variant.name, LAYER_PAIR.search(text).group(0))


def _runner(cfg, params, kv=None, **settings) -> ModelRunner:
    """A runner with the Pallas ops, greedy-only prompt steps and the fresh-prompt steps from 32 tokens."""
    config = EngineConfig.from_options(max_num_seqs=4, max_num_batched_tokens=64, greedy_mixed_step=True,
                                       fresh_prompt_attention=True, fresh_prompt_min_tokens=32,
                                       **settings).resolved("cpu", False)
    return ModelRunner(cfg, params, get_ops("pallas"), config, num_pages=33, max_model_len=256, kv_dtype=kv)


def test_split_prompt_step_parts_lower(small_model):
    """A one-sequence prompt step as two executables (runner.SplitStep): both parts lower for CUDA with the
    Pallas ops over per-layer weights, the head taking the first layer's matrices only."""
    cfg = load_config(small_model, "bfloat16")
    params = split_layers(load_params(small_model, cfg, progress=False))
    runner = _runner(cfg, params, unroll_layers=True, prompt_step_head_layers=1)
    variant, batch = next((v, b) for v, b in runner.bucket_calls() if v.name == "mixed-greedy-fresh")
    parts = runner.steps[variant].parts(runner.params, runner.kv, runner.state, batch)
    assert [part for part, _, _ in parts] == ["head", "tail"]
    for _, fn, args in parts:
        assert TRITON_CALL in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    head_args = parts[0][2][0]
    assert head_args["layers"][1] is None and "lm_head" not in head_args


@pytest.mark.parametrize("shape", [QWEN3_4B, LLAMA3_8B], ids=["qwen3-4b", "llama3-8b"])
@pytest.mark.parametrize("batch,context", [(1, 1024), (1, 8192), (8, 1024), (64, 1024), (256, 2048)])
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_decode_attention_kernels_lower_at_real_shapes(shape, batch, context, kv_dtype):
    H, K = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape.get("head_dim") or shape["hidden_size"] // H
    ps, L = 16, 2
    P = context // ps
    sd = jax.ShapeDtypeStruct
    cache = sd((L, K, (batch * P + 1) * ps, hd), kv_dtype)
    rows, pt, i32 = sd((batch,), jnp.int32), sd((batch, P), jnp.int32), sd((), jnp.int32)
    norm = sd((L, hd), jnp.bfloat16) if shape is QWEN3_4B else None   # Qwen3 has per-head q/k norms
    config = DA.choose_config(batch, K, P * ps, jnp.dtype(kv_dtype).itemsize)

    def fused(qkv, cs, qn, kc, vc, layer, slots, pt, cl):
        return decode_attention_rope_write(qkv, cs, cs, qn, qn, kc, vc, layer, slots, pt, cl, page_size=ps,
                                           scale=hd ** -0.5, num_heads=H, num_kv_heads=K, config=config)

    text = _lower(fused, sd((batch, (H + 2 * K) * hd), jnp.bfloat16), sd((batch, hd), jnp.bfloat16), norm,
                  cache, cache, i32, rows, pt, rows)
    assert TRITON_CALL in text

    def plain(q, kc, vc, layer, pt, cl):
        return DA.paged_decode_attention(q, kc, vc, layer, pt, cl, ps, hd ** -0.5, config=config)

    assert TRITON_CALL in _lower(plain, sd((batch, H, hd), jnp.bfloat16), cache, cache, i32, pt, rows)


@pytest.mark.parametrize("rows", [2, 4])
def test_fused_gemv_with_several_rows_per_program_lowers_at_real_shapes(rows):
    """The decode GEMV with `rows` output rows per program (tables.GEMV_ROWS), at each Qwen3-4B projection."""
    from jaxinfer.pallas.fused_gemv import fused_gemv

    D, I = QWEN3_4B["hidden_size"], QWEN3_4B["intermediate_size"]
    H, K, hd = QWEN3_4B["num_attention_heads"], QWEN3_4B["num_key_value_heads"], QWEN3_4B["head_dim"]
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    for n, k, epilogue in [((H + 2 * K) * hd, D, "none"), (D, H * hd, "residual"), (2 * I, D, "swiglu"),
                           (D, I + 8, "residual")]:   # the last with a masked tile
        extra = sd((1, D), bf) if epilogue == "residual" else sd((2, k), bf)   # the residual, or a norm scale

        def gemv(x, w, e, epilogue=epilogue):
            kw = dict(residual=e) if epilogue == "residual" else dict(scale=e)
            return fused_gemv(x, w, 1, rows=rows, epilogue=epilogue, **kw)

        assert TRITON_CALL in _lower(gemv, sd((1, k), bf), sd((2, n, k), bf), extra)


@pytest.mark.parametrize("shape", [QWEN3_4B, LLAMA3_8B], ids=["qwen3-4b", "llama3-8b"])
@pytest.mark.parametrize("T", [1, 1000, 2048])
@pytest.mark.parametrize("tiles", [8, 32])
def test_tiled_rope_kv_write_lowers_at_real_shapes(shape, T, tiles):
    """The prompt step's norm/RoPE/cache-write kernel with a program's tokens as tiles (tables.ROPE_KV_WRITE_TILE), the
    fresh prompt's k/v returned too, at bf16 and float8 caches."""
    from jaxinfer.pallas.rope_kv_write import qkv_rope_write

    H, K = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape.get("head_dim") or shape["hidden_size"] // H
    sd = jax.ShapeDtypeStruct
    norm = sd((2, hd), jnp.bfloat16) if shape is QWEN3_4B else None
    for kv_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        cache = sd((2, K, 4096, hd), kv_dtype)

        def write(qkv, cs, qn, kc, vc, slots):
            return qkv_rope_write(qkv, cs, cs, qn, qn, kc, vc, 1, slots, num_heads=H, num_kv_heads=K, with_kv=True,
                                  tiled=tiles)

        text = _lower(write, sd((T, (H + 2 * K) * hd), jnp.bfloat16), sd((T, hd), jnp.bfloat16), norm, cache, cache,
                      sd((T,), jnp.int32))
        assert TRITON_CALL in text


@pytest.mark.parametrize("hd", [24, 96])
def test_rope_kv_write_lowers_with_padded_columns(hd):
    """Head dims whose halves are no power of two (12, 48): the kernel's tiles take padded, masked columns."""
    from jaxinfer.pallas.rope_kv_write import qkv_rope_write

    H, K, T = 8, 2, 13
    sd = jax.ShapeDtypeStruct
    cache = sd((2, K, 256, hd), jnp.bfloat16)

    def write(qkv, cs, qn, kc, vc, slots):
        return qkv_rope_write(qkv, cs, cs, qn, qn, kc, vc, 1, slots, num_heads=H, num_kv_heads=K, with_kv=True)

    text = _lower(write, sd((T, (H + 2 * K) * hd), jnp.bfloat16), sd((T, hd), jnp.bfloat16), sd((2, hd), jnp.bfloat16),
                  cache, cache, sd((T,), jnp.int32))
    assert TRITON_CALL in text


@pytest.mark.parametrize("rows", [2, 17, 63])
def test_fp8_lm_head_rows_lower_on_the_skinny_kernel(monkeypatch, rows):
    """An fp8 lm_head at Qwen3-4B's vocabulary at 2-63 rows (ops.pallas.logits: the skinny kernel with float32
    outputs, per-channel scales) lowers to one Triton call and no XLA dot."""
    from jaxinfer.ops.quantized import QuantizedWeight
    from jaxinfer.pallas import tables

    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", 64)
    V, D = QWEN3_4B["vocab_size"], QWEN3_4B["hidden_size"]
    sd = jax.ShapeDtypeStruct
    ops = get_ops("pallas")

    def logits(x, values, scale):
        return ops.logits(x, QuantizedWeight(values, scale))

    text = _lower(logits, sd((rows, D), jnp.bfloat16), sd((V, D), jnp.float8_e4m3fn), sd((V,), jnp.float32))
    assert text.count(TRITON_CALL) == 1 and "stablehlo.dot_general" not in text
