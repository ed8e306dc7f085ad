"""Mixture-of-experts families (Qwen3-MoE, Mixtral): the Pallas op (grouped GEMM, interpret mode) against the
reference op, the tiny transformers models end to end on the Pallas ops, and the configurations and settings
that are refused with one clear error."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA, rel_err
from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import ModelLoadError
from jaxinfer.model.config import config_from_hf, load_config
from jaxinfer.model.transformer import prompt_logits
from jaxinfer.model.weights import load_params
from jaxinfer.ops import LayerWeight, get_ops, reference

MOE = ["qwen3_moe", "mixtral"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 3, 13])
def test_pallas_moe_mlp_matches_reference(T, dtype):
    """One token (row items, no sort) and several (sorted rows), weights of a layer of a stack, top-k with and
    without renormalisation."""
    E, D, I, k, L = 6, 64, 40, 3, 2
    keys = jax.random.split(jax.random.PRNGKey(T), 4)
    x = jax.random.normal(keys[0], (T, D), jnp.float32).astype(dtype)
    router = LayerWeight(jax.random.normal(keys[1], (L, E, D), jnp.float32).astype(dtype), jnp.int32(1))
    gate_up = LayerWeight((jax.random.normal(keys[2], (L, E, 2 * I, D)) / 8).astype(dtype), jnp.int32(1))
    down = LayerWeight((jax.random.normal(keys[3], (L, E, D, I)) / 6).astype(dtype), jnp.int32(1))
    pallas = get_ops("pallas-interpret")
    for renormalize in (False, True):
        want = reference.moe_mlp(x, router, gate_up, down, k, renormalize)
        got = pallas.moe_mlp(x, router, gate_up, down, k, renormalize)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_err(got, want) <= (1e-5 if dtype == jnp.float32 else 2e-2)


def test_routing_matches_a_dense_formulation():
    """reference.moe_mlp (sorted rows, ragged_dot) against every expert on every row, masked to the top k."""
    E, D, I, k, T = 5, 32, 24, 2, 9
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (T, D))
    router, gate_up, down = (jax.random.normal(keys[1], (E, D)), jax.random.normal(keys[2], (E, 2 * I, D)) / 6,
                             jax.random.normal(keys[3], (E, D, I)) / 5)
    hp = jax.lax.Precision.HIGHEST
    probs = jax.nn.softmax(x @ router.T, axis=-1)
    top = jnp.argsort(-probs, axis=-1)[:, :k]
    w = jnp.take_along_axis(probs, top, axis=-1)
    w = w / w.sum(-1, keepdims=True)
    every = jnp.einsum("tei,edi->ted", reference.swiglu(jnp.einsum("td,eod->teo", x, gate_up, precision=hp)), down,
                       precision=hp)   # every expert's output on every row [T, E, D]
    dense = jnp.einsum("tk,tkd->td", w, jnp.take_along_axis(every, top[..., None], axis=1), precision=hp)
    np.testing.assert_allclose(reference.moe_mlp(x, router, gate_up, down, k, True), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", MOE)
def test_pallas_interpret_logits_match_transformers(family):
    """Prompt rows through the grouped GEMM (sorted by expert) give transformers' float32 logits."""
    d = DATA / "models" / family
    cfg = load_config(d)
    params = load_params(d, cfg, progress=False)
    golden = np.load(DATA / "golden" / f"{family}.npz")
    for i in (0, 3):
        ours = np.asarray(prompt_logits(cfg, get_ops("pallas-interpret"), params, golden[f"prompt_{i}"]))
        assert np.max(np.abs(ours - golden[f"logits_{i}"])) <= 1e-4, f"{family} prompt {i}"


@pytest.mark.parametrize("family", MOE)
def test_pallas_interpret_greedy_matches_transformers(family):
    """End to end on the Pallas ops: prompts, batch-1 decode (row items) and two-sequence decode (sorted rows)
    give transformers' greedy tokens."""
    golden = np.load(DATA / "golden" / f"{family}.npz")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for seqs in (1, 2):
        llm = LLM(DATA / "models" / family, ops="pallas-interpret", max_num_seqs=seqs, max_num_batched_tokens=32,
                  decode_steps=4, skip_tokenizer_init=True, progress=False)
        outs = llm.generate([golden[f"prompt_{i}"].tolist() for i in range(2)], params)
        for i, out in enumerate(outs):
            assert out.outputs[0].token_ids == golden[f"greedy_{i}"][:8].tolist(), f"{family} {seqs} seqs prompt {i}"


def _hf(tmp_path, family, **changes):
    d = tmp_path / family
    shutil.copytree(DATA / "models" / family, d)
    hf = json.loads((d / "config.json").read_text())
    hf.update(changes)
    (d / "config.json").write_text(json.dumps(hf))
    return d, hf


def test_unsupported_moe_settings_are_one_clear_error(tmp_path):
    d, hf = _hf(tmp_path, "qwen3_moe")
    with pytest.raises(ModelLoadError, match="dense layers"):
        config_from_hf({**hf, "mlp_only_layers": [1]})
    with pytest.raises(ModelLoadError, match="dense layers"):
        config_from_hf({**hf, "decoder_sparse_step": 2})
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        config_from_hf({**hf, "num_experts_per_tok": 9})
    cfg = load_config(d)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 3, 32)
    assert not cfg.norm_topk_prob and cfg.qk_norm
    assert load_config(DATA / "models" / "mixtral").norm_topk_prob   # Mixtral always renormalises



@pytest.mark.parametrize("T", [1, 3])
def test_pallas_norm_and_moe_block_matches_reference(T):
    """rms_norm_moe_mlp (a layer's whole MoE block) on the split layers' operands: one-layer expert stacks, the norm
    scale in the stacked vectors at its own layer; at one token the norm is folded into the GEMVs."""
    E, D, I, k = 6, 64, 40, 2
    keys = jax.random.split(jax.random.PRNGKey(10 + T), 5)
    x = jax.random.normal(keys[0], (T, D))
    scale = LayerWeight(1 + 0.2 * jax.random.normal(keys[1], (3, D)), jnp.int32(2))
    router = LayerWeight(jax.random.normal(keys[2], (1, E, D)), jnp.int32(0))
    gate_up = LayerWeight(jax.random.normal(keys[3], (1, E, 2 * I, D)) / 8, jnp.int32(0))
    down = LayerWeight(jax.random.normal(keys[4], (1, E, D, I)) / 6, jnp.int32(0))
    want = reference.rms_norm_moe_mlp(x, scale, 1e-6, router, gate_up, down, k, True)
    got = get_ops("pallas-interpret").rms_norm_moe_mlp(x, scale, 1e-6, router, gate_up, down, k, True)
    assert rel_err(got, want) <= 1e-5


def test_per_layer_loading_gives_the_split_layers_tree():
    """load_params(per_layer=True) (the GPU engine's unrolled layers): each layer's experts assembled on the host
    and sent as one [E, N, K] array, equal to split_layers of the stacked tree."""
    from jaxinfer.model.transformer import split_layers

    d = DATA / "models" / "qwen3_moe"
    cfg = load_config(d)
    ours = load_params(d, cfg, progress=False, per_layer=True)
    want = split_layers(load_params(d, cfg, progress=False))
    assert jax.tree.structure(ours) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ours["layers"][0]["moe_gate_up"].shape == (8, 64, 64)


def test_sliding_windows_on_every_layer_as_transformers_applies_them():
    """Mixtral's `sliding_window` and Qwen3-MoE's (with `use_sliding_window`) on every layer (transformers' masks);
    Qwen3-MoE's without use_sliding_window is ignored, as transformers' config drops it."""
    for family, extra in (("mixtral", {}), ("qwen3_moe", {"use_sliding_window": True})):
        hf = json.loads((DATA / "models" / family / "config.json").read_text())
        assert config_from_hf({**hf, "sliding_window": 16, **extra}).layer_windows == (16, 16, 16)
        assert config_from_hf({**hf, "sliding_window": None}).layer_windows == ()
    hf = json.loads((DATA / "models" / "qwen3_moe" / "config.json").read_text())
    assert config_from_hf({**hf, "sliding_window": 16, "use_sliding_window": False}).layer_windows == ()


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scanned"])
def test_engine_steps_lower_to_triton(tmp_path, monkeypatch, unroll):
    """Every compiled step of a small Qwen3-MoE (head dim 128, 8 experts of 128) on the Pallas ops lowers for an
    H200 (on the CPU, as tests/test_triton_lowering.py does), no pair of layer indices joined into one operand."""
    from jax._src.pallas.triton import gpu_info
    from test_triton_lowering import LAYER_PAIR, SMALL, TRITON_CALL, _runner

    from bench.random_model import QWEN3_30B_A3B, write_random_model
    from jaxinfer.model.transformer import split_layers

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    d = write_random_model(tmp_path / "m", {**QWEN3_30B_A3B, **SMALL, "moe_intermediate_size": 128, "num_experts": 8,
                                            "num_experts_per_tok": 2}, dtype="bfloat16")
    cfg = load_config(d, "bfloat16")
    params = load_params(d, cfg, progress=False)
    runner = _runner(cfg, split_layers(params) if unroll else params, unroll_layers=unroll, decode_steps=2)
    kernels = set()
    for variant, batch in runner.bucket_calls():
        text = runner.steps[variant].trace(runner.params, runner.kv, runner.state, batch).lower(
            lowering_platforms=("cuda",)).as_text()
        assert TRITON_CALL in text, variant.name
        assert not LAYER_PAIR.search(text), variant.name
        kernels |= {k for k in ("routed_gemv_swiglu", "routed_gemv_combine", "grouped_gemm_swiglu") if k in text}
    assert kernels == {"routed_gemv_swiglu", "routed_gemv_combine", "grouped_gemm_swiglu"}
