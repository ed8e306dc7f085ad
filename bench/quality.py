"""What quantization costs in quality: each quantized configuration against the unquantized model on the same text.

    PYTHONPATH=. .venv/bin/python bench/quality.py [--models stories260k llama2xs-260k qwen3 ...] [--out bench/results]
    PYTHONPATH=. .venv/bin/python bench/quality.py --make-text    # rewrites bench/data/quality_text.json

For every model and configuration (CONFIGURATIONS: int8 weights, fp8 weights, fp8 W8A8, int8 W8A8, fp8 KV cache, int8
KV cache; add one a line), over
every position of the text (each story is one window from its BOS; a model with a shorter context reads the first
max_position_embeddings tokens of each): the mean KL divergence of the next-token distributions KL(unquantized ||
quantized), top-1 agreement (the same argmax) and the perplexity ratio (quantized over unquantized, of the text's
own next tokens). Float32 compute on the CPU, reference ops, one forward pass a window. "fp8 W8A8" and "int8 W8A8" run
the projections through ops.pallas's routing instead (interpret mode; attention stays the reference's) with
tables.FP8_W8A8_ROWS = INT8_W8A8_ROWS = 1: every row of a window (all past the skinny kernel's 64) quantized to e4m3
(int8) with a scale of its own before its 8-bit product (ops.pallas.w8a8_product, int8_w8a8_product), as prompt rows
run on the GPU from those tables' rows on; a mixture of experts' experts likewise (GROUPED_W8A8_ROWS = 1: the grouped
GEMM's W8A8, interpret mode).

The text: stories sampled (temperature 1) from stories260k, seeded, with the TinyStories tokenizer
(bench/data/quality_text.json, made by --make-text). stories260k and llama2xs-260k are real trained models; the
tiny families of tests/data/models are random weights, read the same token ids (their vocabularies are larger).
Prints one table and writes quality.json under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import load_config
from jaxinfer.model.kv_cache import KVCache, kv_cache_dtype
from jaxinfer.model.transformer import forward
from jaxinfer.model.weights import load_params
from jaxinfer.ops import get_ops, reference
from jaxinfer.pallas.skinny_gemm import MAX_T as SKINNY_MAX_T

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "models"
TEXT = REPO / "bench" / "data" / "quality_text.json"
REAL = ("stories260k", "llama2xs-260k")
TINY = ("gpt2", "llama2", "llama3", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
PAGE = 16


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One quantized configuration: EngineConfig's settings of the same names."""

    name: str
    quantization: str | None = None     # weights
    kv_cache_dtype: str = "auto"        # the KV cache
    w8a8: bool = False                  # the 8-bit weights' products with each row of x in 8 bits too (W8A8: fp8,
                                        # ops.pallas.w8a8_product; int8, ops.pallas.int8_w8a8_product)


CONFIGURATIONS = [
    Configuration("int8 weights", quantization="int8"),
    Configuration("fp8 weights", quantization="fp8"),
    Configuration("fp8 W8A8", quantization="fp8", w8a8=True),
    Configuration("int8 W8A8", quantization="int8", w8a8=True),
    Configuration("fp8 KV cache", kv_cache_dtype="fp8"),
    Configuration("int8 KV cache", kv_cache_dtype="int8"),
]


def model_dir(name: str) -> Path:
    return SHARED / name if name in REAL else REPO / "tests" / "data" / "models" / name


@functools.partial(jax.jit, static_argnums=(0, 1))
def _window_logits(cfg, ops, params, kv, ids):
    """Logits [T, V] at every position of one window ids [T] from position 0, through the paged cache kv."""
    T = ids.shape[0]
    pos = jnp.arange(T, dtype=jnp.int32)
    pages = jnp.arange(1, T // PAGE + 1, dtype=jnp.int32)
    slots = pages[pos // PAGE] * PAGE + pos % PAGE
    _, logits = forward(cfg, ops, params, kv, ids, pos, slots, jnp.zeros(T, jnp.int32), pages[None, :], pos)
    return logits


# The ops that take a weight matrix: ops.pallas's (kernels and XLA's products, its routing) in a W8A8 configuration.
PROJECTIONS = ("linear", "rms_norm_linear", "rms_norm_swiglu", "linear_residual", "linear_residual_norm_swiglu",
               "logits", "moe_mlp", "rms_norm_moe_mlp")


@functools.cache
def w8a8_ops():
    """The reference ops with ops.pallas's projections (interpret mode) in their place: rows past the skinny kernel's
    reach ops.pallas._xla_product, W8A8 from tables.FP8_W8A8_ROWS rows on. One object (a static jit argument)."""
    from jaxinfer.ops import pallas

    ops = {name: getattr(reference, name) for name in dir(reference) if not name.startswith("_")}
    ops.update({name: functools.partial(getattr(pallas, name), interpret=True) for name in PROJECTIONS})
    return pallas.OpSet(**ops, name="reference+w8a8")


@contextlib.contextmanager
def w8a8_rows(rows: int | None):
    """tables.FP8_W8A8_ROWS, INT8_W8A8_ROWS and GROUPED_W8A8_ROWS (a mixture of experts' grouped GEMMs) = rows inside
    (jax's trace cache cleared on both sides: it does not see the tables)."""
    from jaxinfer.pallas import tables

    saved = tables.FP8_W8A8_ROWS, tables.INT8_W8A8_ROWS, tables.GROUPED_W8A8_ROWS
    tables.FP8_W8A8_ROWS = tables.INT8_W8A8_ROWS = tables.GROUPED_W8A8_ROWS = rows
    jax.clear_caches()
    try:
        yield
    finally:
        tables.FP8_W8A8_ROWS, tables.INT8_W8A8_ROWS, tables.GROUPED_W8A8_ROWS = saved
        jax.clear_caches()


def window_logits(cfg, params, ids: np.ndarray, kv_dtype, ops=None) -> np.ndarray:
    """Float32 logits of the window (padded at the end to a multiple of the page: causal, the real rows see no
    padding), without the padding's rows; ops: the reference ops unless given."""
    T = len(ids)
    padded = -(-T // PAGE) * PAGE
    kv = KVCache.allocate(cfg, padded // PAGE + 1, PAGE, kv_dtype)
    x = np.zeros(padded, np.int32)
    x[:T] = ids
    return np.asarray(_window_logits(cfg, ops or get_ops("reference"), params, kv, jnp.asarray(x)), np.float64)[:T]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def compare(base: np.ndarray, quant: np.ndarray, targets: np.ndarray) -> dict:
    """Per-position sums over one window: KL(base || quant), top-1 agreements, and each model's NLL of targets."""
    lp, lq = log_softmax(base), log_softmax(quant)
    rows = np.arange(len(targets))
    return {"kl": float((np.exp(lp) * (lp - lq)).sum()), "top1": int((base.argmax(-1) == quant.argmax(-1)).sum()),
            "nll_base": float(-lp[rows, targets].sum()), "nll_quant": float(-lq[rows, targets].sum()),
            "positions": len(targets)}


def evaluate(name: str, windows: list[list[int]], configurations: list[Configuration]) -> list[dict]:
    folder = model_dir(name)
    cfg = load_config(folder, "float32")
    windows = [np.asarray(w[:cfg.max_position_embeddings], np.int32) for w in windows]
    base_params = load_params(folder, cfg, progress=False)
    base = [window_logits(cfg, base_params, w, None) for w in windows]
    del base_params
    rows = []
    for c in configurations:
        try:
            params = load_params(folder, cfg, progress=False, quantization=c.quantization)
            kv_dtype = kv_cache_dtype(cfg, c.kv_cache_dtype)
            total: dict = {}
            if c.w8a8 and min(map(len, windows)) <= SKINNY_MAX_T:   # those rows would take the weight-only kernel
                raise ValueError(f"W8A8 needs windows of more than {SKINNY_MAX_T} tokens")
            with w8a8_rows(1) if c.w8a8 else contextlib.nullcontext():
                for w, b in zip(windows, base):
                    part = compare(b[:-1], window_logits(cfg, params, w, kv_dtype, w8a8_ops() if c.w8a8 else None)[:-1],
                                   w[1:])
                    total = {k: total.get(k, 0) + v for k, v in part.items()}
            n = total["positions"]
            rows.append({"model": name, "configuration": c.name, "positions": n, "kl": total["kl"] / n,
                         "top1": total["top1"] / n, "ppl_base": float(np.exp(total["nll_base"] / n)),
                         "ppl_quant": float(np.exp(total["nll_quant"] / n)),
                         "ppl_ratio": float(np.exp((total["nll_quant"] - total["nll_base"]) / n))})
        except Exception as e:   # a row that fails keeps its error; the others still run
            rows.append({"model": name, "configuration": c.name, "error": f"{type(e).__name__}: {e}"})
        print(_row(rows[-1]), flush=True)
    return rows


HEADER = ("| model | configuration | positions | mean KL (nats) | top-1 agreement | perplexity (unquantized) | "
          "perplexity ratio |\n|---|---|---|---|---|---|---|")


def _row(r: dict) -> str:
    if "error" in r:
        return f"| {r['model']} | {r['configuration']} | failed: {r['error'][:120]} | | | | |"
    return (f"| {r['model']} | {r['configuration']} | {r['positions']:,} | {r['kl']:.5f} | {100 * r['top1']:.1f}% | "
            f"{r['ppl_base']:.4g} | {r['ppl_ratio']:.4f} |")


def read_windows(n: int | None = None) -> list[list[int]]:
    """The text's token ids, a story a window (the first n stories; None: all)."""
    return json.loads(TEXT.read_text())["ids"][:n]


def make_text(stories: int, tokens: int) -> None:
    """Sample `stories` stories of at most `tokens` tokens from stories260k (temperature 1, seeds 0..) and write
    them with their token ids (BOS first) to TEXT."""
    from jaxinfer import LLM, SamplingParams

    llm = LLM(SHARED / "stories260k", dtype="float32", ops="reference", max_num_seqs=stories, progress=False)
    openings = ["Once upon a time", "One day", "Tom and Sue", "The sun was", "There was a big", "Lily wanted",
                "A little bird", "Max had a"]
    prompts = [openings[i % len(openings)] for i in range(stories)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=tokens, temperature=1.0, seed=i) for i in range(stories)])
    windows = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    TEXT.parent.mkdir(parents=True, exist_ok=True)
    TEXT.write_text(json.dumps({
        "made_by": "PYTHONPATH=. .venv/bin/python bench/quality.py --make-text (stories260k, temperature 1, seeds "
                   f"0..{stories - 1}, at most {tokens} new tokens a story)",
        "text": [llm.tokenizer.decode(w) for w in windows], "ids": windows}, indent=1) + "\n")
    print(f"{TEXT}: {stories} stories, {sum(len(w) - 1 for w in windows)} positions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=[*REAL, *TINY], help="real: stories260k, llama2xs-260k; tiny: "
                    + ", ".join(TINY))
    ap.add_argument("--configurations", nargs="+", default=[c.name for c in CONFIGURATIONS],
                    help="; ".join(c.name for c in CONFIGURATIONS))
    ap.add_argument("--windows", type=int, default=None, help="the first N stories only (default all)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--make-text", action="store_true", help="sample the text again (stories260k) and stop")
    ap.add_argument("--stories", type=int, default=8, help="with --make-text")
    ap.add_argument("--tokens", type=int, default=240, help="with --make-text: the most new tokens a story")
    args = ap.parse_args()
    if args.make_text:
        make_text(args.stories, args.tokens)
        return
    unknown = set(args.configurations) - {c.name for c in CONFIGURATIONS}
    if unknown:
        sys.exit(f"unknown configurations {sorted(unknown)}")
    configurations = [c for c in CONFIGURATIONS if c.name in args.configurations]
    windows = read_windows(args.windows)
    print(f"# {platform.processor() or platform.machine()}, {jax.devices()[0].platform}, jax {jax.__version__}; "
          f"float32, reference ops; text {TEXT.name}: {len(windows)} windows")
    print(HEADER, flush=True)
    rows = [r for name in args.models for r in evaluate(name, windows, configurations)]
    print("\n" + HEADER)
    for r in rows:
        print(_row(r))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "argv": sys.argv[1:],
        "jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
