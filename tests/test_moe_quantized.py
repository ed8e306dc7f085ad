"""8-bit experts (quantization="int8" / "fp8" at load on Qwen3-MoE and Mixtral): the expert stacks held as
QuantizedWeights with one scale an expert's output row (the router in the model's dtype), the routed GEMVs' 8-bit
reads against reference.grouped_linear's, the tiny models end to end on the reference and Pallas (interpret) ops,
close to the float models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA, rel_err
from jaxinfer import LLM, SamplingParams
from jaxinfer.model.config import load_config
from jaxinfer.model.transformer import prompt_logits, split_layers
from jaxinfer.model.weights import load_params
from jaxinfer.ops import LayerWeight, get_ops, reference
from jaxinfer.ops.quantized import FORMATS, QuantizedWeight, quantize
from jaxinfer.pallas import tables
from jaxinfer.pallas.blocks import silu_mul
from jaxinfer.pallas.moe_gemv import routed_gemv

MOE = ["qwen3_moe", "mixtral"]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("family", MOE)
def test_experts_quantized_at_load(family, fmt):
    d = DATA / "models" / family
    cfg = load_config(d)
    params = load_params(d, cfg, progress=False)
    q = load_params(d, cfg, progress=False, quantization=fmt)
    for name in ("moe_gate_up", "moe_down"):
        w = q["layers"][name]
        assert isinstance(w, QuantizedWeight) and w.values.dtype == jnp.dtype(FORMATS[fmt])
        assert w.scale.shape == w.values.shape[:3]   # [L, E, out]: one scale an expert's output row
        np.testing.assert_array_equal(np.asarray(w.values), np.asarray(quantize(params["layers"][name], fmt).values))
    assert not isinstance(q["layers"]["router"], QuantizedWeight)
    per_layer, split = load_params(d, cfg, progress=False, per_layer=True, quantization=fmt), split_layers(q)
    for i in range(cfg.num_layers):
        for name in ("moe_gate_up", "moe_down"):
            a, b = per_layer["layers"][i][name], split["layers"][i][name]
            np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values))
            np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("E, k, D, I", [(6, 3, 72, 40), (8, 2, 64, 48), (4, 2, 272, 300)])
def test_routed_gemvs_read_8bit_experts_as_the_reference(E, k, D, I, fmt):
    """The batch-1 block (router GEMV, gate/up and combine routed GEMVs) with 8-bit expert stacks, in interpret mode,
    against reference.rms_norm_moe_mlp on the same QuantizedWeights (sorted rows, ragged_dot of the exact values,
    each row's sums times its expert's channel scales); depths past the unrolled tiles at (4, 2, 272, 300)."""
    keys = jax.random.split(jax.random.PRNGKey(E * D + I), 5)
    x = jax.random.normal(keys[0], (1, D))
    scale = LayerWeight(1 + 0.2 * jax.random.normal(keys[1], (2, D)), jnp.int32(1))
    router = LayerWeight(jax.random.normal(keys[2], (2, E, D)), jnp.int32(1))
    gate_up = LayerWeight(quantize(jax.random.normal(keys[3], (2, E, 2 * I, D)) / 8, fmt), jnp.int32(1))
    down = LayerWeight(quantize(jax.random.normal(keys[4], (2, E, D, I)) / 6, fmt), jnp.int32(1))
    pallas = get_ops("pallas-interpret")
    for renormalize in (False, True):
        want = reference.rms_norm_moe_mlp(x, scale, 1e-6, router, gate_up, down, k, renormalize)
        got = pallas.rms_norm_moe_mlp(x, scale, 1e-6, router, gate_up, down, k, renormalize)
        assert rel_err(got, want) <= 1e-5
        # the float experts the 8-bit ones stand for: close, not equal
        deq = [LayerWeight(w.stacked.dequantize(), w.layer) for w in (gate_up, down)]
        assert rel_err(got, reference.rms_norm_moe_mlp(x, scale, 1e-6, router, *deq, k, renormalize)) <= 1e-5


def _block_quantize(w, block):
    """w [..., out, in] as float8 e4m3 with one scale a (bo, bi) block (the official Qwen3 FP8 format's layout)."""
    bo, bi = block
    *lead, out, inp = w.shape
    nbo, nbi = -(-out // bo), -(-inp // bi)
    padded = jnp.zeros((*lead, nbo * bo, nbi * bi)).at[..., :out, :inp].set(w)
    amax = jnp.abs(padded.reshape(*lead, nbo, bo, nbi, bi)).max(axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    full = jnp.repeat(jnp.repeat(scale, bo, axis=-2), bi, axis=-1)[..., :out, :inp]
    return QuantizedWeight(jnp.clip(w / full, -448, 448).astype(jnp.float8_e4m3fn), scale, block)


@pytest.mark.parametrize("block", [(16, 16), (24, 32), (128, 128)])
def test_routed_gemvs_read_block_scaled_experts_as_the_reference(block):
    """e4m3 experts with one scale a (bo, bi) block, partial blocks at the edges (and one block of the whole matrix
    at 128 x 128, the tiny checkpoints' case), against the reference's product of the dequantized experts."""
    E, k, D, I = 6, 2, 96, 40
    keys = jax.random.split(jax.random.PRNGKey(sum(block)), 5)
    x = jax.random.normal(keys[0], (1, D))
    scale = LayerWeight(1 + 0.2 * jax.random.normal(keys[1], (2, D)), jnp.int32(1))
    router = LayerWeight(jax.random.normal(keys[2], (2, E, D)), jnp.int32(1))
    gate_up = LayerWeight(_block_quantize(jax.random.normal(keys[3], (2, E, 2 * I, D)) / 8, block), jnp.int32(1))
    down = LayerWeight(_block_quantize(jax.random.normal(keys[4], (2, E, D, I)) / 6, block), jnp.int32(1))
    want = reference.rms_norm_moe_mlp(x, scale, 1e-6, router, gate_up, down, k, True)
    got = get_ops("pallas-interpret").rms_norm_moe_mlp(x, scale, 1e-6, router, gate_up, down, k, True)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("T", [3, 13])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block"])
def test_grouped_gemm_reads_8bit_experts_as_the_reference(fmt, T):
    """Prompt / batched-decode rows (the grouped GEMM over expert-sorted rows, split K where the groups are small)
    with 8-bit experts: per-channel scales after the sums, or 16 x 16 block scales on each depth tile, against
    reference.moe_mlp on the same QuantizedWeights."""
    E, k, D, I = 6, 2, 96, 40
    keys = jax.random.split(jax.random.PRNGKey(T), 4)
    x = jax.random.normal(keys[0], (T, D))
    router = LayerWeight(jax.random.normal(keys[1], (2, E, D)), jnp.int32(1))

    def q(w):
        return _block_quantize(w, (16, 16)) if fmt == "fp8-block" else quantize(w, fmt)
    gate_up = LayerWeight(q(jax.random.normal(keys[2], (2, E, 2 * I, D)) / 8), jnp.int32(1))
    down = LayerWeight(q(jax.random.normal(keys[3], (2, E, D, I)) / 6), jnp.int32(1))
    want = reference.moe_mlp(x, router, gate_up, down, k, True)
    got = get_ops("pallas-interpret").moe_mlp(x, router, gate_up, down, k, True)
    assert rel_err(got, want) <= 1e-5


def test_grouped_linear_8bit_is_the_dequantized_product():
    """reference.grouped_linear on a QuantizedWeight: each row's product with its group's dequantized matrix (rows
    past the groups' sum zeros), within float32 rounding."""
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    w = quantize(jax.random.normal(keys[0], (4, 24, 40)), "int8")
    x = jax.random.normal(keys[1], (11, 40))
    sizes = jnp.array([3, 0, 5, 2], jnp.int32)   # 10 rows in groups, the 11th past them
    got = reference.grouped_linear(x, w, sizes)
    group = np.repeat(np.arange(4), np.asarray(sizes))
    deq = np.asarray(w.dequantize())
    want = np.stack([deq[g] @ np.asarray(x[r]) for r, g in enumerate(group)] + [np.zeros(24, np.float32)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_bad_8bit_expert_operands_are_one_clear_error():
    w = quantize(jax.random.normal(jax.random.PRNGKey(0), (1, 4, 16, 32)), "int8")
    x, logits = jnp.ones((1, 32)), jnp.zeros((1, 4))
    kw = dict(top_k=2, renormalize=True, epilogue="swiglu", interpret=True)
    with pytest.raises(ValueError, match="w_scale"):
        routed_gemv(x, logits, w.values, **kw)   # 8-bit values without their scales
    with pytest.raises(ValueError, match="w_scale"):
        routed_gemv(x, logits, w.values, w_scale=w.scale[..., :8], **kw)
    with pytest.raises(ValueError, match="w_scale"):   # block scales of the wrong grid
        routed_gemv(x, logits, w.values, w_scale=jnp.ones((1, 4, 2, 1)), w_block=(16, 16), **kw)


@pytest.mark.parametrize("family", MOE)
def test_8bit_experts_end_to_end_close_to_float(family):
    """int8 weights (attention, experts, lm_head) at load: a random prompt's 64 positions' next-token distributions
    close to the float model's (mean KL, top-1 agreement), and greedy
    tokens of the Pallas ops (interpret mode: prompt rows through the reference's grouped product, batch-1 decode
    through the 8-bit routed GEMVs) equal to the reference ops' on the same quantized weights."""
    d = DATA / "models" / family
    cfg = load_config(d)
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, 64)
    floats = np.asarray(prompt_logits(cfg, get_ops("reference"), load_params(d, cfg, progress=False), prompt))
    q = load_params(d, cfg, progress=False, quantization="int8")
    ours = np.asarray(prompt_logits(cfg, get_ops("reference"), q, prompt))
    p, r = jax.nn.softmax(floats, -1), jax.nn.log_softmax(ours, -1)
    kl = float(np.mean(np.sum(p * (np.log(np.maximum(p, 1e-30)) - r), -1)))
    top1 = float(np.mean(floats.argmax(-1) == ours.argmax(-1)))
    print(f"{family} int8: KL {kl:.2e}, top-1 {top1:.3f} over {len(prompt)} positions")
    assert kl <= 0.1 and top1 >= 0.8   # the dense tiny families: KL 0.003-0.013, top-1 93-96% (a lost scale: KL ~1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for ops in ("reference", "pallas-interpret"):   # the Pallas ops on unrolled layers (per-layer 8-bit arrays)
        llm = LLM(d, ops=ops, quantization="int8", unroll_layers=ops != "reference", max_num_seqs=1,
                  max_num_batched_tokens=32, decode_steps=4, skip_tokenizer_init=True, progress=False)
        outs[ops] = [o.outputs[0].token_ids for o in llm.generate([prompt.tolist()], params)]
    assert outs["pallas-interpret"] == outs["reference"]


PREQUANTIZED_MOE = DATA / "models" / "qwen3_moe-fp8-block"   # tools/make_quantized_checkpoints.py: 16 x 16 blocks


def _dequantized_from_files(folder, layer: int, expert: int) -> dict[str, np.ndarray]:
    """An expert's gate|up and down matrices dequantized from the checkpoint's files with numpy alone (its float8
    values times each 16 x 16 block's weight_scale_inv)."""
    from test_quantization import load_file

    t = load_file(folder / "model.safetensors")

    def one(name):
        v, s = t[name + ".weight"].astype(np.float32), t[name + ".weight_scale_inv"]
        return v * np.repeat(np.repeat(s, 16, 0), 16, 1)[:v.shape[0], :v.shape[1]]

    base = f"model.layers.{layer}.mlp.experts.{expert}"
    return {"moe_gate_up": np.concatenate([one(f"{base}.gate_proj"), one(f"{base}.up_proj")]),
            "moe_down": one(f"{base}.down_proj")}


def test_prequantized_moe_checkpoint_equals_independent_dequantization():
    """The official Qwen3 FP8 block format on a Qwen3-MoE: every expert's matrices read with their block scales
    (gate and up joined on the blocks' grid), the router kept float; the model's logits near the float model's."""
    cfg = load_config(PREQUANTIZED_MOE)
    params = load_params(PREQUANTIZED_MOE, cfg, progress=False)
    for name in ("moe_gate_up", "moe_down"):
        w = params["layers"][name]
        assert isinstance(w, QuantizedWeight) and w.values.dtype == jnp.float8_e4m3fn and w.block == (16, 16)
    assert not isinstance(params["layers"]["router"], QuantizedWeight)
    for layer, expert in ((0, 0), (1, 5), (cfg.num_layers - 1, cfg.num_experts - 1)):
        for name, want in _dequantized_from_files(PREQUANTIZED_MOE, layer, expert).items():
            got = np.asarray(params["layers"][name][layer][expert].dequantize())
            np.testing.assert_array_equal(got, want, err_msg=f"{name} layer {layer} expert {expert}")
    base_cfg = load_config(DATA / "models" / "qwen3_moe")
    base = load_params(DATA / "models" / "qwen3_moe", base_cfg, progress=False)
    ids = np.arange(3, 40)
    got = np.asarray(prompt_logits(cfg, get_ops("reference"), params, ids))
    ref = np.asarray(prompt_logits(base_cfg, get_ops("reference"), base, ids))
    # e4m3's 3 mantissa bits, with routing flips: quantizing this model to fp8 per channel at load gives 0.164 (int8
    # 0.054); its 16 x 16 blocks here 0.183
    assert rel_err(got, ref) < 0.25
    per_layer = load_params(PREQUANTIZED_MOE, cfg, progress=False, per_layer=True)
    np.testing.assert_array_equal(np.asarray(per_layer["layers"][1]["moe_down"].scale),
                                  np.asarray(params["layers"]["moe_down"].scale[1]))


def test_prequantized_moe_checkpoint_greedy_on_the_pallas_ops():
    """Greedy tokens of the FP8 block-scaled Qwen3-MoE: the Pallas ops (interpret; batch-1 decode through the
    block-scaled routed GEMVs, unrolled layers) equal the reference ops'."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = np.random.default_rng(1).integers(3, 1000, 24).tolist()
    outs = {}
    for ops in ("reference", "pallas-interpret"):
        llm = LLM(PREQUANTIZED_MOE, ops=ops, unroll_layers=ops != "reference", max_num_seqs=1,
                  max_num_batched_tokens=32, decode_steps=4, skip_tokenizer_init=True, progress=False)
        assert "fp8" in llm.engine.summary
        outs[ops] = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert outs["pallas-interpret"] == outs["reference"]


@pytest.mark.parametrize("kind, message", [
    ("missing scales", "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv' are missing"),
    ("bad block grid", "with block size [16, 16] needs scales of shape"),
    ("requantized", "does not match it"),
])
def test_bad_prequantized_moe_checkpoint_one_clear_error(tmp_path, kind, message):
    import shutil

    from test_quantization import load_file, save_file

    from jaxinfer.model.quantize import QuantizationError

    folder = tmp_path / "moe"
    shutil.copytree(PREQUANTIZED_MOE, folder)
    t = load_file(folder / "model.safetensors")
    if kind == "missing scales":
        del t["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"]
    elif kind == "bad block grid":
        t["model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    save_file(t, folder / "model.safetensors")
    cfg = load_config(folder)
    with pytest.raises(QuantizationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_params(folder, cfg, progress=False, quantization="int8" if kind == "requantized" else None)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_engine_steps_lower_to_triton(tmp_path, monkeypatch, fmt):
    """Every compiled step of a small Qwen3-MoE quantized at load, on the Pallas ops (unrolled layers, as on the GPU),
    lowers for an H200 on the CPU (tests/test_triton_lowering.py's way), the 8-bit routed GEMVs and grouped GEMM
    among its kernels; and both kernels with 128 x 128 block-scaled e4m3 experts (Qwen3-30B-A3B-FP8's layout)."""
    from jax._src.pallas.triton import gpu_info
    from test_triton_lowering import SMALL, TRITON_CALL, _lower, _runner

    from bench.random_model import QWEN3_30B_A3B, write_random_model

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    d = write_random_model(tmp_path / "m", {**QWEN3_30B_A3B, **SMALL, "moe_intermediate_size": 128, "num_experts": 8,
                                            "num_experts_per_tok": 2}, dtype="bfloat16")
    cfg = load_config(d, "bfloat16")
    params = load_params(d, cfg, progress=False, per_layer=True, quantization=fmt)
    runner = _runner(cfg, params, unroll_layers=True, decode_steps=2)
    kernels = set()
    for variant, batch in runner.bucket_calls():
        text = runner.steps[variant].trace(runner.params, runner.kv, runner.state, batch).lower(
            lowering_platforms=("cuda",)).as_text()
        assert TRITON_CALL in text, variant.name
        kernels |= {k for k in ("routed_gemv_swiglu", "routed_gemv_combine", "grouped_gemm_swiglu") if k in text}
    assert kernels == {"routed_gemv_swiglu", "routed_gemv_combine", "grouped_gemm_swiglu"}
    if fmt == "fp8":
        E, D, I = 8, 256, 128
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        gate_up = _block_quantize(jax.random.normal(keys[0], (1, E, 2 * I, D)), (128, 128))
        down = _block_quantize(jax.random.normal(keys[1], (1, E, D, I)), (128, 128))
        router = jax.random.normal(keys[2], (1, E, D), jnp.bfloat16)
        pallas = get_ops("pallas")
        for T in (1, 64):
            x = jnp.ones((T, D), jnp.bfloat16)
            text = _lower(lambda x, r, g, dn: pallas.rms_norm_moe_mlp(
                x, jnp.ones((D,), jnp.bfloat16), 1e-6, r[0], LayerWeight(g, jnp.int32(0)),
                LayerWeight(dn, jnp.int32(0)), 2, True), x, router, gate_up, down)
            assert TRITON_CALL in text and ("routed_gemv_combine" if T == 1 else "grouped_gemm") in text


# --- W8A8 in the grouped GEMM (grouped_gemm's x_scale; ops.pallas from tables.GROUPED_W8A8_ROWS) -------------------

def _per_row_w8a8(x, q, groups, dtype):
    """Each row's XLA W8A8 product (ops.pallas.xla_w8a8_product) with its group's matrix, rounded to dtype."""
    from jaxinfer.ops.pallas import xla_w8a8_product

    return np.stack([np.asarray(xla_w8a8_product(x[r:r + 1], q[int(g)]).astype(dtype)[0], np.float32)
                     for r, g in enumerate(groups)])


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("epilogue, split", [("none", 1), ("none", 2), ("swiglu", 1), ("swiglu", 3)])
def test_grouped_gemm_w8a8_is_xlas_w8a8_product_row_by_row(fmt, epilogue, split):
    """Rows sorted by expert (an empty expert, a group crossing a row tile), x's rows quantized, 8-bit tile products:
    each row equals XLA's W8A8 product with its expert's matrix (int8 bit for bit: exact int32 sums, the scales in
    XLA's order; e4m3 within a bf16 step), with split K too (the scaled partial sums added in float32)."""
    from jaxinfer.ops.quantized import quantize_rows
    from jaxinfer.pallas.grouped_gemm import GroupedGemmConfig, grouped_gemm, sorted_items

    E, N, K = 4, 48, 160
    sizes = jnp.array([5, 0, 19, 3], jnp.int32)
    M = int(sizes.sum())
    q = quantize(jax.random.normal(jax.random.PRNGKey(split), (2, E, N, K)) / 8, fmt)
    x = (jax.random.normal(jax.random.PRNGKey(7), (M, K)) * jnp.exp(jax.random.normal(jax.random.PRNGKey(8), (M, 1)))
         ).astype(jnp.bfloat16)
    xq, xs = quantize_rows(x, q.dtype)
    cfg = GroupedGemmConfig(block_m=16, block_n=16, block_k=32, split_k=split)
    y = grouped_gemm(xq, q.values, sorted_items(sizes, M, 16), jnp.int32(1), epilogue=epilogue, config=cfg,
                     w_scale=q.scale, x_scale=xs, out_dtype=jnp.bfloat16, interpret=True)
    assert y.dtype == jnp.bfloat16
    want = _per_row_w8a8(x, q[1], np.repeat(np.arange(E), np.asarray(sizes)), jnp.bfloat16)
    if epilogue == "swiglu":
        want = np.asarray(silu_mul(*jnp.split(jnp.asarray(want, jnp.bfloat16), 2, axis=-1)), np.float32)
    got = np.asarray(y, np.float32)
    if fmt == "int8" and split == 1:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2 ** -6, atol=2 ** -6)
        assert np.mean(got == want) > 0.9


def test_grouped_gemm_w8a8_operands_are_checked():
    from jaxinfer.ops.quantized import quantize_rows
    from jaxinfer.pallas.grouped_gemm import grouped_gemm, row_items

    q = quantize(jax.random.normal(jax.random.PRNGKey(0), (3, 32, 64)), "int8")
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 64)).astype(jnp.bfloat16)
    xq, xs = quantize_rows(x, q.dtype)
    items = row_items(jnp.array([0, 2, 1, 1]))
    kw = dict(w_scale=q.scale, interpret=True)
    with pytest.raises(ValueError, match="x_scale"):       # x not quantized
        grouped_gemm(x, q.values, items, x_scale=xs, out_dtype=jnp.bfloat16, **kw)
    with pytest.raises(ValueError, match="should be float32"):
        grouped_gemm(xq, q.values, items, x_scale=xs[:2], out_dtype=jnp.bfloat16, **kw)
    with pytest.raises(ValueError, match="should be float32"):
        grouped_gemm(xq, q.values, items, x_scale=xs, **kw)   # no out_dtype
    with pytest.raises(ValueError, match="only with x_scale"):
        grouped_gemm(x, q.values, items, out_dtype=jnp.float32, **kw)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_moe_mlp_rows_in_w8a8_from_the_tables_rows(monkeypatch, fmt):
    """ops.pallas.moe_mlp with per-channel 8-bit experts: from tables.GROUPED_W8A8_ROWS assignments on, x's rows and
    the SwiGLU's rows quantized before each grouped GEMM, so the block equals the reference composed of each row's
    XLA W8A8 products (int8 bit for bit); below the threshold, with it None, and for block-scaled experts, the
    converted tiles."""
    E, k, D, I, T = 6, 2, 96, 40, 9
    keys = jax.random.split(jax.random.PRNGKey(11), 4)
    x = jax.random.normal(keys[0], (T, D)).astype(jnp.bfloat16)
    router = LayerWeight(jax.random.normal(keys[1], (2, E, D)).astype(jnp.bfloat16), jnp.int32(1))
    gate_up = LayerWeight(quantize(jax.random.normal(keys[2], (2, E, 2 * I, D)) / 8, fmt), jnp.int32(1))
    down = LayerWeight(quantize(jax.random.normal(keys[3], (2, E, D, I)) / 6, fmt), jnp.int32(1))
    ops = get_ops("pallas-interpret")

    def run(threshold, gu=gate_up, dn=down):
        monkeypatch.setattr(tables, "GROUPED_W8A8_ROWS", threshold)
        jax.clear_caches()
        return np.asarray(ops.moe_mlp(x, router, gu, dn, k, True), np.float32)

    # the W8A8 composition: route and sort as the op does, each sorted row's W8A8 products with its expert's
    logits = ops.linear(x, router)
    weights, experts = reference.route(logits, k, True)
    order, sizes = reference.sort_by_expert(experts, E)
    groups = np.repeat(np.arange(E), np.asarray(sizes))
    h = _per_row_w8a8(x[order // k], gate_up.stacked[1], groups, jnp.bfloat16)
    h = silu_mul(*jnp.split(jnp.asarray(h, jnp.bfloat16), 2, axis=-1))
    y = jnp.asarray(_per_row_w8a8(h, down.stacked[1], groups, jnp.bfloat16), jnp.bfloat16)
    y = jnp.zeros_like(y).at[order].set(y).reshape(T, k, D)
    want = np.asarray(jnp.sum(y.astype(jnp.float32) * weights[..., None], axis=1).astype(jnp.bfloat16), np.float32)
    for threshold in (1, T * k):
        got = run(threshold)
        if fmt == "int8":
            np.testing.assert_array_equal(got, want)
        else:
            assert rel_err(got, want) <= 1e-2
    converted = run(None)      # the converted tiles (test_grouped_gemm_reads_8bit_experts_as_the_reference)
    np.testing.assert_array_equal(run(T * k + 1), converted)
    assert not np.array_equal(run(1), converted)      # the activations' rounding is in it
    blocked = [LayerWeight(_block_quantize(w.stacked.dequantize(), (16, 16)), w.layer) for w in (gate_up, down)]
    if fmt == "fp8":    # block scales: converted tiles whatever the threshold
        np.testing.assert_array_equal(run(1, *blocked), run(None, *blocked))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_grouped_gemm_w8a8_lowers_with_8bit_tile_products(fmt):
    """For an H200 (on the CPU, the GPU stubbed in): the W8A8 grouped GEMM's e4m3 dot carries maxNumImpreciseAcc
    (fp8_dot.py) on a row tile of 64 where the items hold 16 rows (wgmma's tile: Triton's mma.sync has no e4m3 form);
    the int8 dot sums in i32 on the items' 16 rows."""
    from bench.kernel_registers import triton_modules
    from jaxinfer.ops.quantized import quantize_rows
    from jaxinfer.pallas.grouped_gemm import GroupedGemmConfig, grouped_gemm, row_items

    q = quantize(jax.random.normal(jax.random.PRNGKey(0), (8, 256, 512)), fmt)
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 512)).astype(jnp.bfloat16)
    xq, xs = quantize_rows(x, q.dtype)
    cfg = GroupedGemmConfig(block_m=16, block_n=64, block_k=64)
    [(attrs, text)] = triton_modules(
        lambda x, v, s, xs, items: grouped_gemm(x, v, items, w_scale=s, x_scale=xs, out_dtype=jnp.bfloat16,
                                                epilogue="swiglu", config=cfg),
        (xq, q.values, q.scale, xs, row_items(jnp.arange(16) % 8)))
    assert attrs["name"] == "grouped_gemm_swiglu_w8a8"
    dots = [line for line in text.splitlines() if "tt.dot" in line]
    ty = {"int8": "i8", "fp8": "f8E4M3FN"}[fmt]
    rows = 64 if fmt == "fp8" else 16
    assert dots and all(f"tensor<{rows}x64x{ty}>" in d for d in dots), dots
    if fmt == "fp8":
        assert all("maxNumImpreciseAcc = 64" in d for d in dots), dots
    else:
        assert all(f"-> tensor<{rows}x64xi32>" in d and "maxNumImpreciseAcc" not in d for d in dots), dots
