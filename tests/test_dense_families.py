"""Phi-3 and Phi-4-mini, Apertus and Gemma 3 against transformers (goldens from tools/make_goldens.py): float32
logits within 1e-4 and 32 greedy tokens equal, on the reference ops and on the Pallas ops in interpret mode; the
RoPE tables behind partial rotary dims and LongRoPE; and one clear error for each part of their configs we do not
take."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA
from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import ModelLoadError
from jaxinfer.model import rotary
from jaxinfer.model.config import config_from_hf, load_config
from jaxinfer.model.transformer import prompt_logits
from jaxinfer.model.weights import load_params
from jaxinfer.ops import get_ops

FAMILIES = ["phi3", "phi4_mini", "apertus", "gemma3"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    d = DATA / "models" / request.param
    cfg = load_config(d)
    return request.param, cfg, load_params(d, cfg, progress=False)


@pytest.mark.parametrize("ops", ["reference", "pallas-interpret"])
def test_prompt_logits_match_transformers(family, ops):
    """Every golden prompt on the reference ops; on the Pallas ops the shortest (batch-1 decode's fused GEMVs take
    its rows) and the longest (the prompt kernels)."""
    name, cfg, params = family
    golden = np.load(DATA / "golden" / f"{name}.npz")
    for i in (range(4) if ops == "reference" else (0, 3)):
        ours = np.asarray(prompt_logits(cfg, get_ops(ops), params, golden[f"prompt_{i}"]))
        err = np.max(np.abs(ours - golden[f"logits_{i}"]))
        assert err <= 1e-4, f"{name} {ops} prompt {i}: max |logits - golden| = {err:.2e}"


def test_per_layer_weights_give_the_same_logits(family):
    """split_layers (the GPU default) against the scan: the xIELU parameters and the per-layer RoPE tables read at
    a layer index of each kind."""
    from jaxinfer.model.transformer import split_layers

    name, cfg, params = family
    prompt = np.load(DATA / "golden" / f"{name}.npz")["prompt_1"]
    stacked = np.asarray(prompt_logits(cfg, get_ops(), params, prompt))
    # (XLA fuses the straight-line layers otherwise: measured up to 2.2e-5 apart on Gemma 3's larger logits)
    np.testing.assert_allclose(np.asarray(prompt_logits(cfg, get_ops(), split_layers(params), prompt)), stacked,
                               atol=5e-5, err_msg=name)


def test_bfloat16_logits_close_to_float32(family):
    """bf16 weights and activations (Gemma's 1 + w rounded to bf16 at load, where transformers keeps it in float32):
    within bf16 rounding of the float32 golden, as tests/test_model_parity.py holds the other families."""
    name, _, _ = family
    d = DATA / "models" / name
    cfg = load_config(d, dtype="bfloat16")
    golden = np.load(DATA / "golden" / f"{name}.npz")
    ours = np.asarray(prompt_logits(cfg, get_ops(), load_params(d, cfg, progress=False), golden["prompt_3"]),
                      np.float32)
    want = golden["logits_3"]
    assert np.max(np.abs(ours - want)) <= 0.08 * np.abs(want).max()
    assert np.mean(np.argmax(ours, -1) == np.argmax(want, -1)) >= 0.75


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_tokens_match_transformers(name):
    """The engine end to end (the prompts in one step, then decode steps): 32 greedy tokens of every golden prompt
    on the reference ops. (Phi-4-mini's prompts all take LongRoPE's long factors: its original length is 4.)"""
    golden = np.load(DATA / "golden" / f"{name}.npz")
    llm = LLM(DATA / "models" / name, max_num_seqs=4, max_num_batched_tokens=64, decode_steps=4,
              skip_tokenizer_init=True, progress=False)
    outs = llm.generate([golden[f"prompt_{i}"].tolist() for i in range(4)], GREEDY)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == golden[f"greedy_{i}"].tolist(), f"{name} prompt {i}"


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_tokens_on_pallas_interpret(name):
    """The same on the Pallas ops in interpret mode (two prompts: interpret mode runs every kernel program on
    the CPU)."""
    golden = np.load(DATA / "golden" / f"{name}.npz")
    llm = LLM(DATA / "models" / name, ops="pallas-interpret", max_num_seqs=2, max_num_batched_tokens=32,
              decode_steps=4, skip_tokenizer_init=True, progress=False)
    outs = llm.generate([golden["prompt_0"].tolist(), golden["prompt_3"].tolist()], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [golden["greedy_0"].tolist(), golden["greedy_3"].tolist()]


def test_partial_rotary_order_keeps_pairs_and_passes_the_rest():
    """Phi-4-mini's layout (head_dim 128, 3/4 rotated): each rotated pair (i, i + 48) lands at (j, j + 64), the
    32 passing dims take frequency 0 (cos 1, sin 0), and a fused q/k/v's v rows keep their order."""
    cfg = config_from_hf(_phi3(partial_rotary_factor=0.75))
    order = rotary.head_row_order(cfg)
    assert sorted(order) == list(range(128))
    for i in range(48):
        j = int(np.flatnonzero(order == i)[0])
        assert j < 64 and order[j + 64] == i + 48
    inv = cfg.rope_inv_freq()
    assert inv.shape == (64,) and np.all(inv[:48] > 0) and np.all(inv[48:] == 0)
    assert np.all(order[np.flatnonzero(inv == 0)] >= 96) and np.all(order[64 + np.flatnonzero(inv == 0)] >= 96)
    rows = rotary.qk_rows(cfg, cfg.q_size + 2 * cfg.kv_size, q_rows=True, fused=True)
    v0 = cfg.q_size + cfg.kv_size
    np.testing.assert_array_equal(rows[v0:], np.arange(v0, v0 + cfg.kv_size))
    np.testing.assert_array_equal(rows[:128], order)


def test_longrope_factors_follow_each_sequences_last_position():
    """A token takes the long factors when its sequence's last position in the step is past the original length
    (20 here): a prompt of 24 all long, one of 11 all short, in one ragged step."""
    cfg = load_config(DATA / "models" / "phi4_mini")
    cfg = dataclasses.replace(cfg, rope_longrope=(*cfg.rope_longrope[:2], 20, cfg.rope_longrope[3]))
    short_cos = np.cos(np.outer(np.arange(30), cfg.rope_inv_freq()))
    long_cos = np.cos(np.outer(np.arange(30), cfg.rope_inv_freq(long=True)))
    positions = jnp.asarray(np.r_[np.arange(11), np.arange(24)], jnp.int32)
    token_seq = jnp.asarray(np.r_[np.zeros(11), np.ones(24)], jnp.int32)
    cos, _ = rotary.cos_sin(cfg, get_ops(), positions, token_seq, 2, jnp.float32, decode=False)
    factor = cfg.rope_longrope[3]
    half = cfg.head_dim // 2
    np.testing.assert_allclose(np.asarray(cos)[:11, :6], factor * short_cos[:11, :6], atol=1e-6)
    np.testing.assert_allclose(np.asarray(cos)[11:, :6], factor * long_cos[:24, :6], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(cos)[:, 6:half], 1.0)   # the passing dims: not scaled


def test_longrope_factors_with_rope_long_follow_each_prompt_and_position():
    """With the engine's rope_long (original length 20): a long prompt's chunk of positions 0..10 all long; another
    sequence's chunk 15..24 short up to position 19 and long from 20 (each token its own position, as decoding)."""
    cfg = load_config(DATA / "models" / "phi4_mini")
    cfg = dataclasses.replace(cfg, rope_longrope=(*cfg.rope_longrope[:2], 20, cfg.rope_longrope[3]))
    short_cos = np.cos(np.outer(np.arange(30), cfg.rope_inv_freq()))[:, :6]
    long_cos = np.cos(np.outer(np.arange(30), cfg.rope_inv_freq(long=True)))[:, :6]
    positions = np.r_[np.arange(11), np.arange(15, 25)]
    token_seq = jnp.asarray(np.r_[np.zeros(11), np.ones(10)], jnp.int32)
    cos, _ = rotary.cos_sin(cfg, get_ops(), jnp.asarray(positions, jnp.int32), token_seq, 2, jnp.float32,
                            decode=False, rope_long=jnp.asarray([True, False]))
    factor = cfg.rope_longrope[3]
    want = np.where((np.arange(21) < 11)[:, None] | (positions >= 20)[:, None], long_cos[positions],
                    short_cos[positions])
    np.testing.assert_allclose(np.asarray(cos)[:, :6], factor * want, atol=1e-6)
    assert rotary.takes_long_factors(cfg, 21) and not rotary.takes_long_factors(cfg, 20)




def test_gemma3_windows_that_bite_on_interleaved_layers():
    """Gemma 3's goldens stay inside its window (64); with the window cut to 8 (layers 0 and 2; layer 1 global, each
    with its own RoPE base) a 40-token prompt's logits move, and the Pallas ops give the reference's."""
    d = DATA / "models" / "gemma3"
    cfg = load_config(d)
    params = load_params(d, cfg, progress=False)
    narrow = dataclasses.replace(cfg, layer_windows=(8, 0, 8))
    prompt = np.random.default_rng(3).integers(3, cfg.vocab_size, 40)
    want = np.asarray(prompt_logits(narrow, get_ops("reference"), params, prompt))
    assert np.max(np.abs(want - np.asarray(prompt_logits(cfg, get_ops("reference"), params, prompt)))) > 1e-2
    got = np.asarray(prompt_logits(narrow, get_ops("pallas-interpret"), params, prompt))
    assert np.max(np.abs(got - want)) <= 1e-4

PHI3 = DATA / "models" / "phi3"   # LongRoPE, original length 64


def _phi3_tokens(prompts, params, **settings) -> list[list[int]]:
    llm = LLM(PHI3, skip_tokenizer_init=True, progress=False, cache_dir="", **settings)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("ops", ["reference", "pallas-interpret"])
def test_longrope_prompt_in_chunks_equals_one_step(ops):
    """Phi-3 (original length 64): a 100-token prompt gives the same greedy tokens in chunks of 32 (the first two
    end before the switch, their keys take the long factors all the same) as in one prompt step, whose first token
    is the argmax of transformers' forward (prompt_logits: every key with the long factors)."""
    prompt = np.random.default_rng(1).integers(3, 1000, 100).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = [_phi3_tokens([prompt], params, ops=ops, max_num_seqs=1, max_num_batched_tokens=budget)[0]
              for budget in (128, 32)]
    assert tokens[0] == tokens[1]
    cfg = load_config(PHI3)
    logits = prompt_logits(cfg, get_ops(), load_params(PHI3, cfg, progress=False), np.asarray(prompt))
    assert tokens[0][0] == int(np.argmax(logits[-1]))


def test_longrope_prefix_cache_keeps_short_and_long_keys_apart():
    """A 40-token prompt (short factors) and a 100-token one that starts with its first 32 tokens (long factors,
    every key): with the prefix cache each one's greedy tokens equal its tokens without it, whichever runs first;
    a repeated long prompt still takes its own cached pages."""
    rng = np.random.default_rng(2)
    long_prompt = rng.integers(3, 1000, 100).tolist()
    prompts = [long_prompt[:32] + rng.integers(3, 1000, 8).tolist(), long_prompt]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    settings = dict(max_num_seqs=1, max_num_batched_tokens=128)
    want = _phi3_tokens(prompts, params, enable_prefix_caching=False, **settings)
    for order in ((0, 1), (1, 0)):
        llm = LLM(PHI3, skip_tokenizer_init=True, progress=False, cache_dir="", **settings)
        got = {i: llm.generate([prompts[i]], params)[0].outputs[0].token_ids for i in order}
        assert [got[0], got[1]] == want, f"order {order}"
    hits = llm.engine.pages.hits
    assert llm.generate([long_prompt], params)[0].outputs[0].token_ids == want[1]
    assert llm.engine.pages.hits - hits == 6   # its 6 full blocks of 16 before the last token


def test_longrope_speculation_across_the_original_length_gives_plain_decodings_tokens():
    """Phi-3 as its own draft (drafts at every step): a 100-token prompt in chunks, then a 50-token prompt whose
    output crosses the original length (64) inside verify steps: the greedy tokens of plain decoding, whose steps
    give each token its own position's factors (and the long prompt's, all long ones)."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 1000, 100).tolist(), rng.integers(3, 1000, 50).tolist()]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    settings = dict(max_num_seqs=2, max_num_batched_tokens=32)
    want = _phi3_tokens(prompts, params, **settings)
    llm = LLM(PHI3, skip_tokenizer_init=True, progress=False, cache_dir="", speculative=f"draft:{PHI3}",
              num_speculative_tokens=3, **settings)
    llm.engine.speculator.adaptive = False
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.speculator.stats.drafted > 0


@pytest.mark.parametrize("name", ["phi3", "llama3"])
def test_step_batches_carry_rope_long_only_with_longrope(name):
    """Every mixed and verify step's batch of a LongRoPE model carries rope_long [B]; another model's None (its
    steps' pytree as it was)."""
    llm = LLM(DATA / "models" / name, skip_tokenizer_init=True, progress=False, cache_dir="", max_num_seqs=2,
              speculative="ngram")
    runner = llm.engine.runner
    mixed = [(batch.shapes(), v.phase) for v, batch in runner.bucket_calls() if v.phase in ("mixed", "verify")]
    assert {phase for _, phase in mixed} == {"mixed", "verify"}
    for shapes, phase in mixed:
        step = shapes.step if phase == "verify" else shapes
        assert step.rope_long == (None if name == "llama3" else step.sample_index)


def _phi3(**kw):
    hf = json.loads((DATA / "models" / "phi3" / "config.json").read_text())
    hf.update(hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, rope_parameters={"rope_type": "default"})
    hf.update(kw)
    return hf


def _gemma3(**kw):
    return {**json.loads((DATA / "models" / "gemma3" / "config.json").read_text()), **kw}


@pytest.mark.parametrize("hf, message", [
    (_phi3(hidden_act="gelu"), "hidden_act 'gelu' for Phi-3"),
    (_phi3(partial_rotary_factor=0.7), "want a positive even number"),
    (_phi3(rope_parameters={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
     "must have 64 entries"),
    (_phi3(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "unsupported rope type 'dynamic'"),
    ({**json.loads((DATA / "models" / "apertus" / "config.json").read_text()), "hidden_act": "silu"},
     "hidden_act 'silu' for Apertus"),
    ({**json.loads((DATA / "models" / "apertus" / "config.json").read_text()), "post_norm": True},
     "Apertus with mlp_bias, post_norm"),
    (_gemma3(attn_logit_softcapping=50.0), "attn_logit_softcapping is not supported"),
    (_gemma3(use_bidirectional_attention=True), "use_bidirectional_attention is not supported"),
    (_gemma3(hidden_activation="silu"), "hidden_activation 'silu' for Gemma 3"),
    (_gemma3(layer_types=["full_attention"]), "want 3 of"),
    (_gemma3(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                              "full_attention": {"rope_type": "default"}}), "sliding-window layers' rope type"),
    ({**json.loads((DATA / "models" / "llama3" / "config.json").read_text()), "partial_rotary_factor": 0.5},
     "partial rotary embeddings are not supported"),
])
def test_unsupported_config_fields_raise_one_clear_error(hf, message):
    with pytest.raises(ModelLoadError, match=message):
        config_from_hf(hf)


def test_gemma3_reads_layer_types_windows_and_two_rope_bases():
    cfg = load_config(DATA / "models" / "gemma3")
    assert cfg.layer_windows == (64, 0, 64) and cfg.rope_local_layers == (True, False, True)
    assert cfg.rope_local_theta == 10000.0 and cfg.rope_linear_factor == 2.0 and cfg.rope_theta == 1e6
    assert cfg.query_scale == 24 ** -0.5 and cfg.embed_scale == 8.0 and cfg.final_logit_softcap == 30.0
    # an older config.json: rope_theta / rope_local_base_freq / rope_scaling, the pattern instead of layer_types
    old = _gemma3(rope_parameters=None, rope_theta=1e6, rope_local_base_freq=1e4, layer_types=None,
                  sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = config_from_hf(old)
    assert cfg.rope_local_layers == (True, False, True) and cfg.rope_linear_factor == 8.0
