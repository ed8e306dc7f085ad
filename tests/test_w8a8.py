"""FP8 W8A8 (ops.pallas.w8a8_product), and INT8 W8A8 (int8_w8a8_product) at the end: each row of x quantized to
e4m3 with a scale of its own, the product of fp8 operands summed in float32, then the row's and the output
channel's scales. Against a float64 numpy reference
(the same rounding of x, ml_dtypes' e4m3 cast) and against the exact product within the e4m3 rounding bound, at
several shapes; stacked LayerWeights and ops.pallas's routing by tables.FP8_W8A8_ROWS; the activation
quantization's fusions in the CPU's HLO; and an engine generating on stories260k with prompt rows in W8A8, its
next-token distributions against the float32 model's (bench/quality.py's KL and top-1).
"""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import STORIES
from jaxinfer import LLM, SamplingParams
from jaxinfer.ops import LayerWeight, get_ops, reference
from jaxinfer.ops.pallas import int8_w8a8_product, w8a8_product
from jaxinfer.ops.quantized import QuantizedWeight, quantize
from jaxinfer.pallas import tables

f32, bf16 = jnp.float32, jnp.bfloat16
OPS = get_ops("pallas-interpret")
REPO = Path(__file__).resolve().parents[1]


def fp8_stack(key, L, n_out, n_in) -> QuantizedWeight:
    """A random matrix stack quantized as load_params quantizes (fp8, a scale per output channel)."""
    return quantize(jax.random.normal(key, (L, n_out, n_in), f32) / np.sqrt(n_in), "fp8")


def w8a8_float64(x, q: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the W8A8 product in float64, |the same terms| summed (the accumulation's scale), the exact x @ W) with x
    rounded to e4m3 as w8a8_product rounds it: max |x| of the row, 448 / max in float32, the scaled row in float32,
    clipped, cast to e4m3 (ml_dtypes, to nearest even)."""
    xf = np.asarray(x.astype(f32))
    amax = np.maximum(np.abs(xf).max(axis=1, keepdims=True), np.float32(1e-30))
    xs = np.clip(xf * (np.float32(448) / amax), -448, 448).astype(np.float32)
    xq = xs.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    v = np.asarray(q.values.astype(f32), np.float64)
    row, col = amax.astype(np.float64) / 448, np.asarray(q.scale, np.float64)[None, :]
    w = v * col.T
    return (xq @ v.T) * row * col, (np.abs(xq) @ np.abs(v).T) * row * col, xf.astype(np.float64) @ w.T


SHAPES = [(1, 96, 256), (7, 40, 72), (70, 130, 520), (33, 256, 96)]   # (rows, out, in)


@pytest.mark.parametrize("dtype", [bf16, f32])
@pytest.mark.parametrize("T,n_out,n_in", SHAPES)
def test_w8a8_product_against_float64(T, n_out, n_in, dtype):
    seed = T * 1000 + n_out + n_in
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = (jax.random.normal(kx, (T, n_in), f32) * jnp.exp(jax.random.normal(kw, (T, 1)))).astype(dtype)
    q = fp8_stack(kw, 1, n_out, n_in)[0]
    y = np.asarray(w8a8_product(x, q), np.float64)
    assert y.shape == (T, n_out)
    want, magnitude, exact = w8a8_float64(x, q)
    # float32 sums of K terms, then two float32 products: at worst (K + 3) units of 2^-24 of the terms' magnitude
    np.testing.assert_array_less(np.abs(y - want), (n_in + 3) * 2.0 ** -24 * magnitude + 1e-30)
    # against the unquantized x: e4m3 keeps 3 mantissa bits (a half unit: 2^-4 of |v|), below 2^-6 a step of 2^-9
    # (half: 2^-10) in units of max |x| / 448; each term's error times |w|, summed, plus the float32 sums
    xf = np.abs(np.asarray(x.astype(f32), np.float64))
    amax = xf.max(axis=1, keepdims=True)
    w_abs = np.abs(np.asarray(q.values.astype(f32), np.float64) * np.asarray(q.scale, np.float64)[:, None])
    bound = ((2.0 ** -4 + 2.0 ** -22) * xf + 2.0 ** -10 * amax / 448) @ w_abs.T + (n_in + 3) * 2.0 ** -24 * magnitude
    np.testing.assert_array_less(np.abs(y - exact), bound)
    # and the activations were quantized (an unquantized product would sit within float32 rounding of exact)
    assert np.linalg.norm(y - exact) > 1e-3 * np.linalg.norm(exact)


def test_w8a8_product_reads_a_layer_of_a_stack():
    """A LayerWeight over a deeper stack (a traced layer, the scanned layers') and a one-layer stack (the split
    layers') give the layer's product, bit for bit."""
    q = fp8_stack(jax.random.PRNGKey(1), 3, 48, 64)
    x = jax.random.normal(jax.random.PRNGKey(2), (20, 64), bf16)
    want = np.asarray(w8a8_product(x, q[2]))
    traced = jax.jit(lambda x, q, layer: w8a8_product(x, LayerWeight(q, layer)))(x, q, jnp.int32(2))
    np.testing.assert_array_equal(np.asarray(traced), want)
    one = jax.tree.map(lambda a: a[2][None], q)
    split = jax.jit(lambda x, one: w8a8_product(x, LayerWeight(one, jnp.int32(0))))(x, one)
    np.testing.assert_array_equal(np.asarray(split), want)


def test_w8a8_product_refuses_other_formats():
    w = jax.random.normal(jax.random.PRNGKey(3), (32, 64), f32)
    x = jnp.ones((4, 64), bf16)
    with pytest.raises(ValueError, match="per output channel"):
        w8a8_product(x, quantize(w, "int8"))
    blocked = QuantizedWeight(quantize(w, "fp8").values, jnp.ones((1, 1), f32), (32, 64))
    with pytest.raises(ValueError, match="per output channel"):
        w8a8_product(x, blocked)


def test_the_twin_sums_fp8_in_float32_and_the_ops_path_does_not_ask_it():
    """On the GPU, XLA's fp8 GEMM at the default precision uses cuBLAS's fast accumulation (openxla/xla#6599), whose
    sums keep fewer bits than the kernels' (promoted to float32 every k tile): the kernels' twin asks HIGHEST, the
    ops' own XLA path does not (its speed is what the tables compare against). int8 sums are exact either way."""
    from jaxinfer.ops import twins
    from jaxinfer.ops.pallas import xla_w8a8_product

    x = jax.random.normal(jax.random.PRNGKey(1), (8, 64), bf16)
    q = fp8_stack(jax.random.PRNGKey(2), 1, 32, 64)[0]
    q8 = quantize(jax.random.normal(jax.random.PRNGKey(3), (32, 64), f32), "int8")
    hlo = lambda f, *a: jax.jit(f).lower(*a).as_text()
    def precision(text: str) -> list[str]:   # of each dot of e4m3 operands
        dots = [line for line in text.splitlines() if "dot_general" in line and "f8E4M3FN>" in line]
        return [(re.search(r"precision = \[(\w+),", d) or [None, "DEFAULT"])[1] for d in dots]

    assert precision(hlo(lambda x, q: xla_w8a8_product(x, q, precise=True), x, q)) == ["HIGHEST"]
    assert precision(hlo(lambda x, q: twins.hopper_gemm_w8a8(x, q), x, q)) == ["HIGHEST"]
    assert precision(hlo(lambda x, q: xla_w8a8_product(x, q), x, q)) == ["DEFAULT"]
    # the same values on the CPU (float32 sums either way), and int8's exact sums whatever is asked
    np.testing.assert_array_equal(np.asarray(xla_w8a8_product(x, q, precise=True)),
                                  np.asarray(xla_w8a8_product(x, q)))
    np.testing.assert_array_equal(np.asarray(xla_w8a8_product(x, q8, precise=True)),
                                  np.asarray(int8_w8a8_product(x, q8)))


@pytest.mark.parametrize("rows", [70, 100])
def test_routing_by_fp8_w8a8_rows(monkeypatch, rows):
    """ops.pallas sends rows past the skinny kernel's to XLA's product: W8A8 from tables.FP8_W8A8_ROWS rows on (the
    linear ops over a stacked LayerWeight at a traced layer, and the logits), the converted values below it and
    with the table None; int8 weights always the converted values."""
    q = fp8_stack(jax.random.PRNGKey(4), 3, 96, 128)
    x = jax.random.normal(jax.random.PRNGKey(5), (rows, 128), bf16)
    res = jax.random.normal(jax.random.PRNGKey(6), (rows, 96), bf16)
    lw = LayerWeight(q, jnp.int32(1))
    w8a8 = w8a8_product(x, q[1])
    converted = reference.quantized_product(x, q[1])

    def run(threshold):
        monkeypatch.setattr(tables, "FP8_W8A8_ROWS", threshold)
        jax.clear_caches()
        lin = jax.jit(lambda x, q, layer: OPS.linear(x, LayerWeight(q, layer)))(x, q, jnp.int32(1))
        return lin, OPS.linear_residual(x, lw, None, res), OPS.logits(x, q[1])

    for threshold, want in ((rows, w8a8), (64, w8a8), (rows + 1, converted), (None, converted)):
        lin, resid, logits = run(threshold)
        np.testing.assert_array_equal(np.asarray(lin), np.asarray(want.astype(bf16)))
        np.testing.assert_array_equal(np.asarray(resid), np.asarray(res + want.astype(bf16)))
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))
    assert not np.array_equal(np.asarray(w8a8.astype(bf16)), np.asarray(converted.astype(bf16)))
    q8 = quantize(jax.random.normal(jax.random.PRNGKey(7), (96, 128), f32), "int8")
    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", 1)
    jax.clear_caches()
    np.testing.assert_array_equal(np.asarray(OPS.logits(x, q8)), np.asarray(reference.quantized_product(x, q8)))


def test_activation_quantization_fusions_on_the_cpu():
    """The jitted product's HLO on the CPU: x is read twice, by the row maximum's reduction and by one fusion that
    scales, clips and casts it to e4m3 (the max taken in x's dtype: no float32 copy of x is written); the [T] row
    factors between them are a fusion of their own. A row reduction and a consumer of its broadcast cannot share a
    loop fusion, so two passes over x is the least XLA's fusions give (on the GPU: a reduction and a loop kernel)."""
    q = fp8_stack(jax.random.PRNGKey(8), 1, 96, 64)[0]
    x = jnp.ones((80, 64), bf16)
    hlo = jax.jit(w8a8_product).lower(x, q).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    x_name = re.search(r"%(\S+) = bf16\[80,64\]\S* parameter\(0\)", entry).group(1)
    readers = [line for line in entry.splitlines() if f"%{x_name})" in line or f"%{x_name}," in line]
    assert len(readers) == 2, readers
    kinds = {}
    for line in readers:
        out_type = line.split("=")[1].split()[0]
        body = re.search(rf"\n%{re.escape(re.search(r'calls=%([\w.]+)', line).group(1))} .*?\n}}", hlo, re.S).group(0)
        kinds["reduce" if out_type.startswith("bf16[80]") else "quantize"] = body
    assert set(kinds) == {"reduce", "quantize"}, readers
    quant = kinds["quantize"]
    assert "f8e4m3fn[80,64]" in quant and "clamp(" in quant and "multiply(" in quant, quant
    assert not re.search(r"= f32\[80,64\]\S* fusion\(%" + re.escape(x_name) + r"\)", entry)   # no f32 copy of x


def test_engine_prompt_rows_in_w8a8_on_stories260k(monkeypatch):
    """quantization="fp8" with FP8_W8A8_ROWS = 1: the prompt's rows (past the skinny kernel's 64) run as W8A8 in the
    engine (pallas-interpret ops). It generates; each prompt position's top-1 token (prompt logprobs) mostly equals
    the float32 model's, and its logprobs are not weight-only fp8's (the activations were quantized). Then
    bench/quality.py's measure on a window of its text against the float32 model: KL and top-1 within a bound near
    weight-only fp8's (KL 0.0096, top-1 94.2% over the whole text; random logits would be far off)."""
    sys.path.insert(0, str(REPO))
    from bench import quality

    prompt = ("once upon a time there was a little girl named lily. she liked to play in the park with her dog. "
              "one day she saw a big red ball in the grass. she ran to the ball and picked it up. the ball was soft "
              "and round. lily was happy and")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=1)

    def generate(ops, quantization, threshold):
        monkeypatch.setattr(tables, "FP8_W8A8_ROWS", threshold)
        jax.clear_caches()
        llm = LLM(STORIES, ops=ops, quantization=quantization, max_num_seqs=1, max_num_batched_tokens=128,
                  enable_prompt_logprobs=True, progress=False, executable_cache=False)
        out = llm.generate([prompt], params)[0]
        return out, [p[1][0][0] for p in out.prompt_logprobs[1:]], [p[0] for p in out.prompt_logprobs[1:]]

    _, base_top, _ = generate("reference", None, None)
    _, _, fp8_lp = generate("pallas-interpret", "fp8", None)
    out, top, lp = generate("pallas-interpret", "fp8", 1)
    assert len(out.prompt_token_ids) > 64 and len(out.outputs[0].token_ids) == 16
    agree = np.mean(np.array(top) == np.array(base_top))
    assert agree >= 0.85, (agree, top, base_top)
    assert not np.allclose(lp, fp8_lp, rtol=0, atol=1e-4)

    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", None)
    jax.clear_caches()
    fp8, row = quality.evaluate("stories260k", quality.read_windows(1),
                                [c for c in quality.CONFIGURATIONS if c.name in ("fp8 weights", "fp8 W8A8")])
    assert row["configuration"] == "fp8 W8A8" and row["positions"] > 200, row
    assert 0 < row["kl"] <= 0.05 and row["top1"] >= 0.85, row
    assert row["kl"] != fp8["kl"], (row, fp8)   # the activations' rounding reached the logits
    assert tables.FP8_W8A8_ROWS is None          # restored after the configuration


def test_the_fp8_rows_bench_picks_its_table_rows():
    """bench/kernels/fp8_rows.py's table rows from measured points: a skinny row where it beat XLA's faster product
    by 3%; FP8_W8A8_ROWS from the fewest rows where W8A8 beat the converted values at every larger count."""
    sys.path.insert(0, str(REPO))
    from bench.kernels.fp8_rows import table_entries

    def point(M, skinny, w8a8, converted, n=96):
        return dict(n=n, k=64, epilogue="none", M=M, skinny_us=skinny, skinny_cfg=(64, 128, 4, 4, 1), w8a8_us=w8a8,
                    converted_us=converted)

    lines, rows = table_entries([point(16, 9.0, 12.0, 10.0), point(64, 9.9, 12.0, 10.0), point(64, 20, 30, 19, n=32),
                                 point(1024, None, 40.0, 50.0), point(8192, None, 300.0, 400.0)])
    assert lines == [((96, 64, "none", 16), (64, 128, 4, 4, 1), 9.0, 10.0)]
    assert rows == 1024                  # at 64 rows W8A8 lost where the skinny kernel did not take the rows
    lines, rows = table_entries([point(64, 20, 18, 19, n=32), point(1024, None, 40.0, 50.0),
                                 point(8192, None, 300.0, 400.0)])
    assert lines == [] and rows == 64
    assert table_entries([point(8192, None, 401.0, 400.0)]) == ([], None)


def test_the_fp8_rows_bench_patches_the_tables(monkeypatch, tmp_path):
    """--fp8-tables (bench/throughput.py, bench/prefill.py): a --fp8-rows run's JSON sets the two tables."""
    import json

    sys.path.insert(0, str(REPO))
    from bench.kernels.fp8_rows import apply_tables

    def row(M, product, us, config=""):
        return dict(shape="s", projection="qkv", dims="96x64", n=96, k=64, epilogue="none", M=M, weights="fp8",
                    product=product, config=config, us=us, err="1.0e-03")

    rows = [row(16, "routed", 12.0), row(16, "skinny", 8.0, [32, 64, 4, 4, 2]), row(16, "w8a8", 11.0),
            row(16, "converted", 10.0), row(1024, "routed", 50.0), row(1024, "w8a8", 40.0),
            row(1024, "converted", 45.0)]
    (tmp_path / "q.json").write_text(json.dumps(dict(fp8_rows=rows)))
    monkeypatch.setattr(tables, "SKINNY_GEMM_8BIT", {})
    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", None)
    apply_tables(str(tmp_path / "q.json"))
    assert tables.SKINNY_GEMM_8BIT == {(96, 64, "none", 16): tables.SkinnyConfig(32, 64, 4, 4, 2)}
    assert tables.FP8_W8A8_ROWS == 1024


# --- INT8 W8A8 (ops.pallas.int8_w8a8_product) --------------------------------------------------------------------

def int8_w8a8_float64(x, q: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """(the INT8 W8A8 product from exact integer sums, in float64; the exact x @ W) with x rounded to int8 as
    int8_w8a8_product rounds it: max |x| of the row, 127 / max in float32, the scaled row in float32, clipped, rounded
    to nearest even."""
    xf = np.asarray(x.astype(f32))
    amax = np.maximum(np.abs(xf).max(axis=1, keepdims=True), np.float32(1e-30))
    xq = np.round(np.clip(xf * (np.float32(127) / amax), -127, 127)).astype(np.int64)
    sums = xq @ np.asarray(q.values, np.int64).T   # exact
    w = np.asarray(q.values, np.float64) * np.asarray(q.scale, np.float64)[:, None]
    row, col = amax.astype(np.float64) / 127, np.asarray(q.scale, np.float64)[None, :]
    return sums * row * col, xf.astype(np.float64) @ w.T


@pytest.mark.parametrize("dtype", [bf16, f32])
@pytest.mark.parametrize("T,n_out,n_in", SHAPES)
def test_int8_w8a8_product_sums_exactly_and_stays_within_the_rounding(T, n_out, n_in, dtype):
    kx, kw = jax.random.split(jax.random.PRNGKey(T * 7 + n_out + n_in))
    x = (jax.random.normal(kx, (T, n_in), f32) * jnp.exp(jax.random.normal(kw, (T, 1)))).astype(dtype)
    q = quantize(jax.random.normal(kw, (n_out, n_in), f32) / np.sqrt(n_in), "int8")
    y = np.asarray(int8_w8a8_product(x, q), np.float64)
    want, exact = int8_w8a8_float64(x, q)
    # integer sums exact (int32), then float32: the sum's conversion and two products, a few units of 2^-24
    np.testing.assert_allclose(y, want, rtol=4 * 2.0 ** -24, atol=1e-30)
    # against the unquantized x: each element off by at most half a step (max |x| / 254), times |w|
    amax = np.abs(np.asarray(x.astype(f32), np.float64)).max(axis=1, keepdims=True)
    w_abs = np.abs(np.asarray(q.values, np.float64) * np.asarray(q.scale, np.float64)[:, None])
    bound = (amax / 254 * (1 + 2.0 ** -20)) * w_abs.sum(axis=1)[None, :] + 1e-6 * np.abs(exact)
    np.testing.assert_array_less(np.abs(y - exact), bound)
    assert np.linalg.norm(y - exact) > 1e-4 * np.linalg.norm(exact)   # the activations were quantized


def test_int8_w8a8_product_refuses_other_formats():
    w = jax.random.normal(jax.random.PRNGKey(3), (32, 64), f32)
    x = jnp.ones((4, 64), bf16)
    with pytest.raises(ValueError, match="int8 weights with a scale per output channel"):
        int8_w8a8_product(x, quantize(w, "fp8"))


@pytest.mark.parametrize("rows", [70, 100])
def test_routing_by_int8_w8a8_rows(monkeypatch, rows):
    """ops.pallas sends int8 weights' rows past the skinny kernel's to INT8 W8A8 from tables.INT8_W8A8_ROWS rows on
    (a stacked LayerWeight at a traced layer, and the logits), to the converted values below it and with the table
    None; fp8 weights never (their table is FP8_W8A8_ROWS)."""
    q = quantize(jax.random.normal(jax.random.PRNGKey(8), (3, 96, 128), f32) / np.sqrt(128), "int8")
    x = jax.random.normal(jax.random.PRNGKey(9), (rows, 128), bf16)
    w8a8, converted = int8_w8a8_product(x, q[1]), reference.quantized_product(x, q[1])

    def run(threshold):
        monkeypatch.setattr(tables, "INT8_W8A8_ROWS", threshold)
        jax.clear_caches()
        lin = jax.jit(lambda x, q, layer: OPS.linear(x, LayerWeight(q, layer)))(x, q, jnp.int32(1))
        return lin, OPS.logits(x, q[1])

    for threshold, want in ((rows, w8a8), (64, w8a8), (rows + 1, converted), (None, converted)):
        lin, logits = run(threshold)
        np.testing.assert_array_equal(np.asarray(lin), np.asarray(want.astype(bf16)))
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))
    assert not np.array_equal(np.asarray(w8a8.astype(bf16)), np.asarray(converted.astype(bf16)))
    q8 = fp8_stack(jax.random.PRNGKey(10), 1, 96, 128)[0]
    monkeypatch.setattr(tables, "INT8_W8A8_ROWS", 1)
    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", None)
    jax.clear_caches()
    np.testing.assert_array_equal(np.asarray(OPS.logits(x, q8)), np.asarray(reference.quantized_product(x, q8)))


def test_engine_prompt_rows_in_the_mosaic_gemms_w8a8_on_stories260k(monkeypatch):
    """quantization="int8" with INT8_W8A8_ROWS = 1 (XLA's W8A8 product for every prompt row), then the same with
    tables.HOPPER_GEMM_8BIT rows for stories260k's QKV and o_proj at a 128-row prompt chunk, on per-layer matrices
    (unroll_layers, the GPU's layout): the Mosaic GPU GEMM takes those products in W8A8 (interpret mode) and, its int8 sums exact and its scales in XLA's order, the prompt's
    logprobs and the generated tokens are the same bits as XLA's W8A8 path's."""
    from jaxinfer.pallas import hopper_gemm
    from jaxinfer.pallas.hopper_gemm import HopperConfig

    prompt = ("once upon a time there was a little girl named lily. she liked to play in the park with her dog. "
              "one day she saw a big red ball in the grass. she ran to the ball and picked it up. the ball was soft "
              "and round. lily was happy and she ran home to show her mom the ball. her mom smiled and said it was "
              "a very nice ball. lily played with the ball all day and")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=1)
    calls = []
    real = hopper_gemm.hopper_gemm
    monkeypatch.setattr(hopper_gemm, "hopper_gemm", lambda *a, **k: calls.append((a[0].shape, a[0].dtype,
                                                                             k.get("epilogue", "none")))
                        or real(*a, **{**k, "sms": 2}))
    monkeypatch.setattr(tables, "INT8_W8A8_ROWS", 1)

    def generate(table, quantization="int8"):
        monkeypatch.setattr(tables, "HOPPER_GEMM_8BIT", table)
        jax.clear_caches()
        llm = LLM(STORIES, ops="pallas-interpret", quantization=quantization, unroll_layers=True, max_num_seqs=1,
                  max_num_batched_tokens=128, enable_prompt_logprobs=True, progress=False, executable_cache=False)
        out = llm.generate([prompt], params)[0]
        return out.outputs[0].token_ids, [p[0] for p in out.prompt_logprobs[1:]], len(out.prompt_token_ids)

    tokens, logprobs, n_prompt = generate({})
    assert n_prompt > 128 and not calls
    small = HopperConfig(64, 32, 64, 2, epi_n=16)
    kernel_tokens, kernel_logprobs, _ = generate({(128, 64, "none", "int8"): ((128, 128, small),),
                                                  (64, 64, "residual", "int8"): ((128, 128, small),)})
    assert {(shape, jnp.dtype(dtype), ep) for shape, dtype, ep in calls} == {((128, 64), jnp.dtype(jnp.int8), "none"),
                                                                           ((128, 64), jnp.dtype(jnp.int8), "residual")}
    assert kernel_tokens == tokens
    np.testing.assert_array_equal(np.asarray(kernel_logprobs), np.asarray(logprobs))
    # and with the rows quantized by the row-quantization kernel, the norm folded into QKV's: the same tokens, and as
    # close to the unquantized model as with XLA's quantization. Not the same bits here: this model computes in
    # float32, where the kernel's mean of squares, summed in another order, moves a normed value by a float32
    # rounding (a row's scale by an ulp; now and then an int8 value across a rounding boundary, which later
    # positions attend to). tests/test_pallas_row_quantize.py shows the same bits in bf16.
    monkeypatch.setattr(tables, "ROW_QUANTIZE_KERNEL", True)
    row_kernel_tokens, row_kernel_logprobs, _ = generate({(128, 64, "none", "int8"): ((128, 128, small),),
                                                          (64, 64, "residual", "int8"): ((128, 128, small),)})
    monkeypatch.setattr(tables, "INT8_W8A8_ROWS", None)
    _, float_logprobs, _ = generate({}, quantization=None)
    assert row_kernel_tokens == tokens
    cost = lambda lp: np.abs(np.asarray(lp) - np.asarray(float_logprobs)).mean()   # noqa: E731
    assert 0 < cost(row_kernel_logprobs) < 1.25 * cost(logprobs), (cost(row_kernel_logprobs), cost(logprobs))


@pytest.mark.parametrize("rows", [2, 17, 63])
def test_fp8_logits_below_the_w8a8_rows_take_the_skinny_kernel(monkeypatch, rows):
    """An fp8 lm_head at 2 to FP8_W8A8_ROWS - 1 rows: the skinny kernel with float32 outputs (its tiles converted in
    registers, so that a prompt step compiled without XLA's GEMM fusions never writes a bf16 copy of the matrix),
    per-channel and block scales, the 8-bit twin's sums; with FP8_W8A8_ROWS None, or int8 weights, XLA's converted
    values as before."""
    from jaxinfer.ops import twins
    from jaxinfer.pallas import skinny_gemm

    calls = []
    real = skinny_gemm.skinny_gemm
    monkeypatch.setattr(skinny_gemm, "skinny_gemm", lambda *a, **k: calls.append(k["out_dtype"]) or real(*a, **k))
    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", 64)
    x = jax.random.normal(jax.random.PRNGKey(11), (rows, 128), bf16)
    per_channel = fp8_stack(jax.random.PRNGKey(12), 1, 200, 128)[0]
    wb = jax.random.normal(jax.random.PRNGKey(13), (200, 128), f32) / np.sqrt(128)
    scale = jnp.max(jnp.abs(wb.reshape(2, 100, 2, 64)), axis=(1, 3)) / 448
    blocked = QuantizedWeight(jnp.clip(wb / jnp.repeat(jnp.repeat(scale, 100, 0), 64, 1), -448, 448)
                              .astype(jnp.float8_e4m3fn), scale, (100, 64))
    for q in (per_channel, blocked):
        calls.clear()
        got = OPS.logits(x, q)
        assert calls == [jnp.float32] and got.dtype == jnp.float32 and got.shape == (rows, 200)
        want = twins.linear_8bit(x, q, out_dtype=jnp.float32)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for threshold, q in ((None, per_channel), (64, quantize(wb, "int8"))):
        monkeypatch.setattr(tables, "FP8_W8A8_ROWS", threshold)
        calls.clear()
        np.testing.assert_array_equal(np.asarray(OPS.logits(x, q)), np.asarray(reference.quantized_product(x, q)))
        assert calls == []
