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


@pytest.mark.parametrize("ops", ["reference", "pallas-interpret"])
@pytest.mark.parametrize("family", SWA_FAMILIES)
def test_windowed_greedy_tokens_match_transformers(family, ops):
    """32 greedy tokens after prompts of 1-4x the window (decode reaching 6x it) equal transformers'."""
    golden = np.load(DATA / "golden" / f"{family}.npz")
    llm = LLM(DATA / "models" / family, ops=ops, max_num_seqs=4, max_num_batched_tokens=32, decode_steps=4,
              skip_tokenizer_init=True, progress=False)
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == golden[f"greedy_{i}"].tolist(), f"{family} {ops} prompt {i}"
