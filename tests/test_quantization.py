"""8-bit weights: quantize / dequantize bounds, the reference ops on QuantizedWeights, quantizing at load,
pre-quantized checkpoints against an independent numpy dequantization of their files, bad input, memory, and a
quantized model end to end."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import DATA, STORIES, rel_err
from jaxinfer.errors import JaxinferError
from jaxinfer.model import quantize as mq
from jaxinfer.model.config import load_config
from jaxinfer.model.transformer import prompt_logits, split_layers
from jaxinfer.model.weights import load_params
from jaxinfer.ops import LayerWeight, reference
from jaxinfer.ops.quantized import FORMATS, QuantizedWeight, join, quantize

LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")
PREQUANTIZED = {"qwen3-fp8-block": "weight_scale_inv", "qwen3-w8a8-int8": "weight_scale",
                "qwen3-fp8-dynamic": "weight_scale"}


_DTYPES = {"F32": np.float32, "F8_E4M3": ml_dtypes.float8_e4m3fn, "I8": np.int8}


def load_file(path):
    """A safetensors file's tensors, parsed here (safetensors' numpy reader knows no float8)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    return {k: np.frombuffer(raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]],
                             _DTYPES[v["dtype"]]).reshape(v["shape"])
            for k, v in header.items() if k != "__metadata__"}


def save_file(tensors, path):
    names = {np.dtype(v): k for k, v in _DTYPES.items()}
    header, offset = {}, 0
    for k, a in tensors.items():
        header[k] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    head = json.dumps(header).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(a.tobytes() for a in tensors.values()))


def _matrix(rng, out, inp):
    w = rng.standard_normal((out, inp)).astype(np.float32) * rng.uniform(0.01, 3, (out, 1)).astype(np.float32)
    w[0] = 0.0   # a row of zeros
    return w


@pytest.mark.parametrize("shape", [(8, 16), (3, 37, 64)])
def test_int8_round_trip_within_half_a_step(shape):
    w = _matrix(np.random.default_rng(0), int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
    q = quantize(jnp.asarray(w), "int8")
    assert q.values.dtype == jnp.int8 and q.scale.shape == shape[:-1] and q.block is None
    amax = np.abs(w).max(-1)
    np.testing.assert_allclose(np.asarray(q.scale), np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)
    err = np.abs(np.asarray(q.dequantize()) - w)
    assert np.all(err <= np.asarray(q.scale)[..., None] * (0.5 + 1e-5))
    assert np.all(np.asarray(q.dequantize()).reshape(-1, shape[-1])[0] == 0)   # the row of zeros


def test_fp8_round_trip_within_the_format_step():
    w = _matrix(np.random.default_rng(1), 48, 96)
    q = quantize(jnp.asarray(w), "fp8")
    assert q.values.dtype == jnp.float8_e4m3fn
    scale = np.asarray(q.scale)[:, None]
    assert np.abs(np.asarray(q.values, np.float32)).max() <= 448
    # e4m3: 3 mantissa bits (half a step: 2^-4 of the value) above 2^-6, steps of 2^-9 below (times the scale)
    err = np.abs(np.asarray(q.dequantize()) - w)
    assert np.all(err <= np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5))


def test_join_regrids_block_scales_exactly():
    rng = np.random.default_rng(2)
    parts = [QuantizedWeight(rng.integers(-127, 128, (o, 96)).astype(np.int8),
                             rng.uniform(0.1, 1, (-(-o // 64), 2)).astype(np.float32), (64, 64)) for o in (64, 32, 40)]
    joined = join(parts)
    assert joined.block == (32, 64) and joined.scale.shape == (5, 2)
    want = np.concatenate([np.asarray(p.dequantize()) for p in parts])
    np.testing.assert_array_equal(np.asarray(joined.dequantize()), want)
    chan = [quantize(jnp.asarray(rng.standard_normal((o, 8)), jnp.float32), "int8") for o in (4, 6)]
    np.testing.assert_array_equal(np.asarray(join(chan).dequantize()),
                                  np.concatenate([np.asarray(c.dequantize()) for c in chan]))


@pytest.mark.parametrize("fmt, block", [("int8", None), ("fp8", None), ("fp8", (16, 32))])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_linear_is_x_times_dequantized(fmt, block, dtype):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 64)), dtype)
    b = jnp.asarray(rng.standard_normal(40), dtype)
    stack = quantize(jnp.asarray(rng.standard_normal((3, 40, 64)), jnp.float32), fmt)
    if block is not None:   # block scales over the same values
        stack = QuantizedWeight(stack.values, jnp.asarray(rng.uniform(0.001, 0.01, (3, 3, 2)), jnp.float32), block)
    w = LayerWeight(stack, jnp.int32(1))
    dq = np.asarray(stack[1].dequantize(), np.float64)
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    y, want = np.asarray(reference.linear(x, w, b), np.float64), xf @ dq.T + np.asarray(b.astype(jnp.float32))
    if dtype == jnp.float32:
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    else:   # rounded to bf16 once (block scales: the dequantized weights too)
        assert rel_err(y, want) < 5e-3
    logits = np.asarray(reference.logits(x, w), np.float64)
    if dtype == jnp.float32 or block is None:   # per channel: bf16 x times the exact 8-bit values, float32 sums
        np.testing.assert_allclose(logits, xf @ dq.T, rtol=1e-5, atol=1e-5)
    else:
        assert rel_err(logits, xf @ dq.T) < 5e-3
    assert reference.linear(x, w).dtype == dtype and reference.logits(x, w).dtype == jnp.float32


@pytest.fixture(scope="module")
def stories():
    cfg = load_config(STORIES, "auto")
    return cfg, load_params(STORIES, cfg, progress=False)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_at_load(stories, fmt):
    cfg, params = stories
    q = load_params(STORIES, cfg, progress=False, quantization=fmt)
    for name in LINEARS:
        w = q["layers"][name]
        assert isinstance(w, QuantizedWeight) and w.values.dtype == jnp.dtype(FORMATS[fmt])
        np.testing.assert_array_equal(np.asarray(w.values), np.asarray(quantize(params["layers"][name], fmt).values))
    # tied embeddings: the lookup keeps the float embedding; the head reads a quantized copy of it
    assert q["embed"].dtype == jnp.float32 and isinstance(q["lm_head"], QuantizedWeight)
    np.testing.assert_array_equal(np.asarray(q["lm_head"].values), np.asarray(quantize(params["embed"], fmt).values))
    # the per-layer layout holds the same arrays as split_layers of the stacked one
    per_layer = load_params(STORIES, cfg, progress=False, per_layer=True, quantization=fmt)
    split = split_layers(q)
    for i in range(cfg.num_layers):
        for name in LINEARS:
            a, b = per_layer["layers"][i][name], split["layers"][i][name]
            np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values))
            np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


def test_large_matrices_quantize_in_chunks_of_rows_alike(stories, monkeypatch):
    cfg, _ = stories
    whole = load_params(STORIES, cfg, progress=False, quantization="int8")
    monkeypatch.setattr(mq, "CHUNK_ELEMENTS", 3000)   # every matrix in chunks, the last one short
    chunked = load_params(STORIES, cfg, progress=False, quantization="int8")
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_quantized_bytes_about_half_of_bf16():
    """Measured on the CPU with the arrays' nbytes: the linear matrices take half their bf16 bytes (plus one float32
    scale a row); the whole model more than half here, as its tied embedding stays bf16 beside the int8 head."""
    cfg = load_config(STORIES, "bfloat16")
    bf16 = load_params(STORIES, cfg, progress=False)
    int8 = load_params(STORIES, cfg, progress=False, quantization="int8")
    mats = lambda p: sum(p["layers"][n].nbytes for n in LINEARS)
    ratio = mats(int8) / mats(bf16)
    assert 0.5 <= ratio < 0.54, ratio
    held, unquantized = mq.weight_bytes(int8, tied=True)
    assert unquantized == mq.weight_bytes(bf16)[0] and held < 0.8 * unquantized, (held, unquantized)
    assert mq.describe(int8, tied=True) == f"int8 weights ({held / 1e6:.2f} MB, bfloat16 would be " \
                                           f"{unquantized / 1e6:.2f} MB)"


def _independent_dequantization(folder, scale_suffix, block):
    """Each layer's q/k/v, o, gate/up, down matrices dequantized from the files with numpy alone, joined as our tree
    joins them."""
    t = load_file(folder / "model.safetensors")

    def deq(name):
        v = t[name].astype(np.float32)
        s = t[name.removesuffix("weight") + scale_suffix].astype(np.float32)
        if block:
            s = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:v.shape[0], :v.shape[1]]
        return v * s

    a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    names = {"wqkv": [a + "q_proj", a + "k_proj", a + "v_proj"], "wo": [a + "o_proj"],
             "w_gate_up": [m + "gate_proj", m + "up_proj"], "w_down": [m + "down_proj"]}
    n = sum(1 for k in t if k.endswith("self_attn.o_proj.weight"))
    return {dest: np.stack([np.concatenate([deq(s.format(i=i) + ".weight") for s in src]) for i in range(n)])
            for dest, src in names.items()}


@pytest.mark.parametrize("name", sorted(PREQUANTIZED))
def test_prequantized_checkpoint_equals_independent_dequantization(name):
    folder = DATA / "models" / name
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    block = qc.get("weight_block_size")
    cfg = load_config(folder, "auto")
    params = load_params(folder, cfg, progress=False)
    want = _independent_dequantization(folder, PREQUANTIZED[name], block)
    for dest, w in want.items():
        got = params["layers"][dest]
        assert isinstance(got, QuantizedWeight) and got.values.dtype.itemsize == 1
        np.testing.assert_array_equal(np.asarray(got.dequantize()), w, err_msg=dest)
    if block:   # q (128 rows) and k, v (64 rows each) on a 64-row grid of the 128x128 blocks' scales
        assert params["layers"]["wqkv"].block == (64, 128)
    # the model's logits stay near the float model's: measured 2.6% (int8) and 11% (e4m3, 3 mantissa bits) relative
    # error on this tiny random model, as quantizing it at load gives
    fmt = "int8" if "int8" in name else "fp8"
    base_cfg = load_config(DATA / "models" / "qwen3", "auto")
    base = load_params(DATA / "models" / "qwen3", base_cfg, progress=False)
    ids = np.arange(3, 40)
    got = np.asarray(prompt_logits(cfg, reference, params, ids))
    ref = np.asarray(prompt_logits(base_cfg, reference, base, ids))
    assert rel_err(got, ref) < (0.04 if fmt == "int8" else 0.15)
    # --quantization naming the checkpoint's own format uses it as published
    same = load_params(folder, cfg, progress=False, quantization=fmt)
    np.testing.assert_array_equal(np.asarray(same["layers"]["wqkv"].values), np.asarray(params["layers"]["wqkv"].values))


def _broken(tmp_path, kind):
    src = DATA / "models" / "qwen3-fp8-block"
    folder = tmp_path / kind.replace(" ", "-")
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    if kind == "unsupported method":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    elif kind == "bad block size":
        config["quantization_config"]["weight_block_size"] = [32, 32]
    elif kind == "missing scales":
        t = load_file(folder / "model.safetensors")
        del t["model.layers.1.mlp.down_proj.weight_scale_inv"]
        save_file(t, folder / "model.safetensors")
    elif kind == "quantized embedding":
        t = load_file(folder / "model.safetensors")
        t["model.embed_tokens.weight_scale_inv"] = np.ones((9, 1), np.float32)
        save_file(t, folder / "model.safetensors")
    elif kind == "4-bit compressed-tensors":
        ct = json.loads((DATA / "models" / "qwen3-w8a8-int8" / "config.json").read_text())["quantization_config"]
        ct["config_groups"]["group_0"]["weights"]["num_bits"] = 4
        config["quantization_config"] = ct
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("kind, message", [
    ("unsupported method", "quant_method 'awq' is not supported"),
    ("bad block size", "with block size [32, 32] needs scales of shape"),
    ("missing scales", "model.layers.1.mlp.down_proj.weight_scale_inv' are missing"),
    ("4-bit compressed-tensors", "4-bit int weights are not supported"),
    ("quantized embedding", "not 'model.embed_tokens.weight'"),
])
def test_bad_quantized_checkpoint_one_clear_error(tmp_path, kind, message):
    folder = _broken(tmp_path, kind)
    with pytest.raises(mq.QuantizationError) as e:
        load_params(folder, load_config(folder, "auto"), progress=False)
    assert isinstance(e.value, (ValueError, JaxinferError))
    assert message in str(e.value), str(e.value)


def test_quantization_setting_must_match_a_prequantized_checkpoint():
    folder = DATA / "models" / "qwen3-fp8-block"
    with pytest.raises(mq.QuantizationError, match="does not match"):
        load_params(folder, load_config(folder, "auto"), progress=False, quantization="int8")


def test_quantized_stories_generates_close_to_float():
    """LLM(..., quantization=...) end to end; greedy text of the quantized model against the float one: the share of
    the first tokens that agree is printed (a quantized model may part from the float one after a near tie)."""
    from jaxinfer import LLM, SamplingParams

    opts = dict(max_num_seqs=2, max_num_batched_tokens=64, progress=False)
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    prompts = ["Once upon a time", "The little dog"]
    want = [o.outputs[0].token_ids for o in LLM(STORIES, **opts).generate(prompts, greedy)]
    llm = LLM(STORIES, quantization="int8", **opts)
    assert "int8 weights" in llm.engine.summary
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    for w, g in zip(want, got):
        assert len(g) == len(w) == 48
        prefix = next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), len(w))
        print(f"int8 greedy: first {prefix} of {len(w)} tokens equal the float model's")
        assert prefix >= 8, (w, g)


def test_cli_bad_quantization_one_line_exit_2(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "stories-awq"
    shutil.copytree(STORIES, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    r = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(folder), "--max-tokens", "2",
                        "Once"], capture_output=True, text=True, timeout=300)
    lines = [line.split("\r")[-1] for line in r.stderr.splitlines()]
    errors = [line for line in lines if line.startswith("jaxinfer: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "quant_method 'awq'" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(STORIES), "--quantization",
                        "int4", "Once"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.parametrize("name", sorted(PREQUANTIZED))
def test_prequantized_checkpoint_matches_transformers(name):
    """Logits against Hugging Face transformers reading the same checkpoint (tools/make_quantized_goldens.py: the FP8
    block format dequantized on the CPU, compressed-tensors decompressed; activations unquantized, as here)."""
    golden = np.load(DATA / "golden" / "quantized.npz")
    folder = DATA / "models" / name
    cfg = load_config(folder, "auto")
    got = np.asarray(prompt_logits(cfg, reference, load_params(folder, cfg, progress=False), golden["ids"]))
    np.testing.assert_allclose(got, golden[name], atol=1e-4, rtol=0)
