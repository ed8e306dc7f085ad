"""Sliding-window attention: the config's reading of each family's window, the reference ops' window mask,
and parity with transformers on tiny Mistral and Qwen2 models whose window (16) is 1-4x shorter than their
prompts (goldens from tools/make_goldens.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA
from jaxinfer.engine.llm import LLM
from jaxinfer.errors import ModelLoadError
from jaxinfer.model.config import config_from_hf, load_config
from jaxinfer.model.transformer import prompt_logits
from jaxinfer.model.weights import load_params
from jaxinfer.ops import get_ops, reference
from jaxinfer.sampling.params import SamplingParams

SWA_FAMILIES = ["mistral_swa", "qwen2_swa"]
BASE = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=4, intermediate_size=96, vocab_size=100,
            max_position_embeddings=256)


def test_config_reads_each_familys_window():
    mistral = config_from_hf({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 32})
    assert mistral.layer_windows == (32, 32, 32, 32) and mistral.has_windows
    qwen = dict(BASE, architectures=["Qwen2ForCausalLM"], sliding_window=32, max_window_layers=2)
    assert config_from_hf({**qwen, "use_sliding_window": True}).layer_windows == (0, 0, 32, 32)
    assert config_from_hf({**qwen, "use_sliding_window": False}).layer_windows == ()
    types = ["sliding_attention", "full_attention"] * 2
    assert config_from_hf({**qwen, "use_sliding_window": True, "layer_types": types}).layer_windows == (32, 0, 32, 0)
    # Llama ignores the field (as transformers does); a window as long as the positions never bites
    assert config_from_hf({**BASE, "architectures": ["LlamaForCausalLM"], "sliding_window": 32}).layer_windows == ()
    long = config_from_hf({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 256})
    assert long.layer_windows == () and long.window_of(0) is None
    with pytest.raises(ModelLoadError, match="layer_types"):
        config_from_hf({**qwen, "use_sliding_window": True, "layer_types": ["sliding_attention"]})
    with pytest.raises(ModelLoadError, match="sliding_window"):
        config_from_hf({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": -4})


@pytest.mark.parametrize("family", ["phi3", "gemma3", "mistral_swa"])
def test_a_window_that_is_not_positive_is_one_clear_error(family):
    """Every family that reads sliding_window refuses a negative one (Phi-3 and Gemma 3 took it as each layer's
    window, under which a query sees no key); Phi-3's window as long as the positions never bites."""
    import json

    hf = json.loads((DATA / "models" / family / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="sliding_window -4: want a positive number"):
        config_from_hf({**hf, "sliding_window": -4})
    if family == "phi3":
        assert config_from_hf({**hf, "sliding_window": 12}).layer_windows == (12, 12, 12)
        assert config_from_hf({**hf, "sliding_window": hf["max_position_embeddings"]}).layer_windows == ()


def _dense_attention(q, k, v, positions, key_positions, window, scale):
    """Attention written out for one sequence: q [T, H, hd] at positions over k, v [S, KVH, hd] at key_positions."""
    H, kvh = q.shape[1], k.shape[1]
    k, v = np.repeat(k, H // kvh, axis=1), np.repeat(v, H // kvh, axis=1)
    s = np.einsum("thd,shd->hts", q, k) * scale
    d = positions[:, None] - key_positions[None, :]
    visible = (d >= 0) & ((d < window) if window else True)
    s = np.where(visible[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("window", [0, 1, 5, 16])
def test_reference_ops_honour_the_window(window):
    """Every reference attention op against the attention written out, one sequence of 40 positions in pages
    of 8 (shuffled), for a traced window (0: global)."""
    rng = np.random.default_rng(window)
    S, H, kvh, hd, ps = 40, 4, 2, 16, 8
    q = rng.standard_normal((S, H, hd)).astype(np.float32)
    k = rng.standard_normal((S, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((S, kvh, hd)).astype(np.float32)
    pages = rng.permutation(np.arange(1, 6)).astype(np.int32)
    pos = np.arange(S, dtype=np.int32)
    slots = pages[pos // ps] * ps + pos % ps
    kc = jnp.zeros((1, kvh, 6 * ps, hd), jnp.float32).at[0, :, slots].set(jnp.asarray(k))
    vc = jnp.zeros((1, kvh, 6 * ps, hd), jnp.float32).at[0, :, slots].set(jnp.asarray(v))
    scale, w, layer = 0.25, jnp.int32(window), jnp.int32(0)
    want = _dense_attention(q, k, v, pos, pos, window, scale)
    table = jnp.asarray(pages)[None]
    got = reference.paged_attention(jnp.asarray(q), kc, vc, layer, table, jnp.zeros(S, jnp.int32), jnp.asarray(pos),
                                    ps, scale, window=w)
    np.testing.assert_allclose(got, want, atol=2e-5)
    got = reference.paged_attention(jnp.asarray(q), kc, vc, layer, table, jnp.zeros(S, jnp.int32), jnp.asarray(pos),
                                    ps, scale, chunk=16, window=w)   # the per-query layout
    np.testing.assert_allclose(got, want, atol=2e-5)
    np.testing.assert_allclose(reference.fresh_prompt_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale,
                                                                window=w), want, atol=2e-5)
    prefix = 19   # a chunk of 21 rows after 19 cached positions
    got = reference.prefixed_chunk_attention(jnp.asarray(q[prefix:]), kc, vc, layer, jnp.asarray(pages), prefix,
                                             jnp.asarray(slots[prefix:]), ps, scale, window=w)
    np.testing.assert_allclose(got, want[prefix:], atol=2e-5)
    got = reference.paged_decode_attention(jnp.asarray(q[None, S - 1]), kc, vc, layer, table, jnp.array([S]), ps,
                                           scale, window=w)
    np.testing.assert_allclose(got[0], want[S - 1], atol=2e-5)
    got = reference.verify_attention(jnp.asarray(q[None, S - 4:]), kc, vc, layer, table, jnp.array([S]), ps, scale,
                                     window=w)
    np.testing.assert_allclose(got[0], want[S - 4:], atol=2e-5)


@pytest.fixture(scope="module", params=SWA_FAMILIES)
def swa_family(request):
    d = DATA / "models" / request.param
    cfg = load_config(d)
    return request.param, cfg, load_params(d, cfg, progress=False)


@pytest.mark.parametrize("ops", ["reference", "pallas-interpret"])
def test_windowed_logits_match_transformers(swa_family, ops):
    """float32 logits of prompts of 1-4x the window within 1e-4 of transformers', stacked and split layers."""
    from jaxinfer.model.transformer import split_layers

    name, cfg, params = swa_family
    assert cfg.has_windows
    golden = np.load(DATA / "golden" / f"{name}.npz")
    for i in range(4):
        p = params if i != 3 else split_layers(params)
        ours = np.asarray(prompt_logits(cfg, get_ops(ops), p, golden[f"prompt_{i}"]))
        err = np.max(np.abs(ours - golden[f"logits_{i}"]))
        assert err <= 1e-4, f"{name} {ops} prompt {i} ({len(golden[f'prompt_{i}'])} tokens): {err:.2e}"


@pytest.mark.parametrize("ops", ["reference", "pallas-interpret", "reference-one-sequence-steps"])
@pytest.mark.parametrize("family", SWA_FAMILIES)
def test_windowed_greedy_tokens_match_transformers(family, ops):
    """32 greedy tokens after prompts of 1-4x the window (decode reaching 6x it) equal transformers'; also with the
    one-sequence prompt steps (fresh and prefixed, which take the paged attention on windowed layers)."""
    golden = np.load(DATA / "golden" / f"{family}.npz")
    steps = {}
    if ops == "reference-one-sequence-steps":
        ops, steps = "reference", dict(fresh_prompt_attention=True, fresh_prompt_min_tokens=16,
                                       prefixed_chunk_attention=True, greedy_mixed_step=True)
    llm = LLM(DATA / "models" / family, ops=ops, max_num_seqs=4, max_num_batched_tokens=32, decode_steps=4,
              skip_tokenizer_init=True, progress=False, **steps)
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    # one at a time for the one-sequence steps (a prompt of 64 in chunks of 32: a fresh step, then a prefixed one)
    outs = [llm.generate([p], params)[0] for p in prompts] if steps else llm.generate(prompts, params)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == golden[f"greedy_{i}"].tolist(), f"{family} {ops} {steps} prompt {i}"


@pytest.mark.parametrize("ops", ["reference", "pallas-interpret"])
def test_pages_behind_every_window_are_freed(ops):
    """Mistral (window 16 on every layer) in pages of 8: a sequence of 64 prompt tokens and 100 new ones holds at
    most the pages of its window (and the next dispatch's) at a time, not the 21 of its length; the freed pages go
    back to the pool (they stay in the prefix cache); the tokens equal those of a run that frees nothing (a
    Qwen2 with a global layer frees nothing)."""
    from jaxinfer.engine.scheduler import _held

    golden = np.load(DATA / "golden" / "mistral_swa.npz")
    prompt = golden["prompt_3"].tolist()
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    opts = dict(ops=ops, max_num_seqs=2, max_num_batched_tokens=32, decode_steps=4, page_size=8,
                skip_tokenizer_init=True, progress=False)
    llm = LLM(DATA / "models" / "mistral_swa", **opts)
    engine = llm.engine
    assert engine.scheduler.window == 16
    rid = engine.add_request(prompt, params)
    held, in_use = [], []
    while engine.has_unfinished():
        engine.step()
        held += [len(_held(s.pages)) for s in engine.scheduler.running]
        in_use.append(engine.pages.num_in_use)
        engine.pages.check()
    out = engine.take_finished(rid)
    assert out.outputs[0].token_ids[:32] == golden["greedy_3"].tolist()
    full = -(-(len(prompt) + 100) // 8)
    # the window (16 positions: 3 pages where it straddles them), the chunk or decode dispatches in flight (the
    # host's view lags two dispatches of 4) and the page being filled
    assert max(held) <= 6 < full, held
    assert engine.scheduler.num_freed_pages >= full - 6
    print(f"{ops}: pages held by the sequence, step by step: {held} of {full}; freed {engine.scheduler.num_freed_pages}")
    # the same tokens from an engine that keeps every page
    keep = LLM(DATA / "models" / "mistral_swa", **opts)
    keep.engine.scheduler.window = 0
    assert keep.generate([prompt], params)[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert keep.engine.scheduler.num_freed_pages == 0
    assert LLM(DATA / "models" / "qwen2_swa", **opts).engine.scheduler.window == 0   # layer 0 is global


def test_freeing_with_the_gpus_overlapped_steps():
    """With the GPU's step overlaps (a prompt step launched before the previous one is read back, or behind a
    decode dispatch in flight; one-sequence prompt steps), the pages freed behind the window change no token:
    four prompts of 1-4x the window, 32 greedy tokens each, equal transformers'."""
    golden = np.load(DATA / "golden" / "mistral_swa.npz")
    llm = LLM(DATA / "models" / "mistral_swa", ops="reference", max_num_seqs=4, max_num_batched_tokens=32,
              decode_steps=4, page_size=8, skip_tokenizer_init=True, progress=False, overlap_mixed=True,
              prefill_behind_decode=True, greedy_mixed_step=True, fresh_prompt_attention=True,
              fresh_prompt_min_tokens=16, prefixed_chunk_attention=True)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = llm.generate([golden[f"prompt_{i}"].tolist() for i in range(4)], params)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == golden[f"greedy_{i}"].tolist(), f"prompt {i}"
    assert llm.engine.scheduler.num_freed_pages > 0
    llm.engine.pages.check()


def test_windows_with_preemption_and_prefix_cache_hits():
    """A pool too small for four sequences (13 pages of 8 for prompts of 1-4x the window: preemptions and
    recomputes) with pages freed behind the windows, then the same prompts again, admitted on the prefix cache's
    pages (some of them freed behind a window before): every run's greedy tokens equal transformers'."""
    golden = np.load(DATA / "golden" / "mistral_swa.npz")
    llm = LLM(DATA / "models" / "mistral_swa", ops="reference", max_num_seqs=4, num_pages=13, max_model_len=96,
              max_num_batched_tokens=64, decode_steps=4, page_size=8, skip_tokenizer_init=True, progress=False)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    order, hits = [3, 2, 1, 0], []
    for run in range(2):
        outs = llm.generate([golden[f"prompt_{i}"].tolist() for i in order], params)
        for i, out in zip(order, outs):
            assert out.outputs[0].token_ids == golden[f"greedy_{i}"].tolist(), f"run {run} prompt {i}"
        llm.engine.pages.check()
        hits.append(llm.engine.pages.hits)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.num_freed_pages > 0
    assert hits[1] > hits[0], hits   # the second run took cached pages
