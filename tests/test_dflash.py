"""The DFlash block drafter against the authors' own implementation (goldens in tests/data/golden/dflash.npz and
the tiny drafter tests/data/models/dflash-tiny for the tiny Qwen3 target, made by tools/make_dflash_golden.py)."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA
from jaxinfer.errors import ModelLoadError
from jaxinfer.model.config import load_config
from jaxinfer.model.weights import load_params
from jaxinfer.ops import get_ops
from jaxinfer.spec.dflash import (DraftContext, draft_logits, draft_logits_from_states, extend_context,
                                  target_embedding_and_head, target_layer_states)
from jaxinfer.spec.dflash_config import (authors_target_layer_ids, check_drafter_fits, dflash_config_from_hf,
                                         load_dflash_config, load_dflash_params, random_dflash_params)

DRAFTER = DATA / "models" / "dflash-tiny"
TARGET = DATA / "models" / "qwen3"
TOL = 1e-4


@pytest.fixture(scope="module")
def setup():
    golden = np.load(DATA / "golden" / "dflash.npz")
    tcfg = load_config(TARGET)
    tparams = load_params(TARGET, tcfg, progress=False)
    dcfg = load_dflash_config(DRAFTER)
    return golden, tcfg, tparams, dcfg, load_dflash_params(DRAFTER, dcfg)


def test_config_reads_the_published_fields(setup):
    _, tcfg, _, dcfg, params = setup
    assert (dcfg.block_size, dcfg.num_drafts, dcfg.mask_token_id) == (4, 3, 1062)
    assert dcfg.target_layer_ids == (0, 2) and dcfg.num_target_layers == 3
    assert (dcfg.model.num_layers, dcfg.model.head_dim, dcfg.model.qk_norm) == (2, 16, True)
    assert params["fc"].shape == (64, 128) and params["layers"]["wqkv"].shape == (2, 64 + 2 * 32, 64)
    check_drafter_fits(dcfg, tcfg)
    # the authors' default layers when a config names none: Qwen3-4B-DFlash-b16's [1, 9, 17, 25, 33]
    assert authors_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert authors_target_layer_ids(28, 1) == (14,)


def test_target_layer_states_match_transformers(setup):
    golden, tcfg, tparams, dcfg, _ = setup
    ours = np.asarray(target_layer_states(tcfg, get_ops(), tparams, golden["token_ids"], dcfg.target_layer_ids))
    assert ours.shape == golden["target_hidden"].shape
    assert np.max(np.abs(ours - golden["target_hidden"])) <= TOL


@pytest.mark.parametrize("step", [1, 2])
def test_draft_logits_from_all_states_match_the_authors(setup, step):
    golden, tcfg, tparams, dcfg, params = setup
    start = int(golden[f"block{step}_start"])
    embed, head = target_embedding_and_head(tcfg, tparams)
    logits = draft_logits_from_states(dcfg, get_ops(), params, jnp.asarray(golden["target_hidden"][:, :start]),
                                      golden[f"block{step}_ids"][0], embed, head)
    assert logits.shape == golden[f"logits{step}"].shape == (dcfg.num_drafts, tcfg.vocab_size)
    assert np.max(np.abs(np.asarray(logits) - golden[f"logits{step}"])) <= TOL


def test_kept_context_grows_step_by_step_as_the_authors_cache(setup):
    """Step 1 from positions 0..6 (written as a padded 8-row chunk), then step 2 adds only 7..9: each step's logits
    equal the authors' cached run; the two contexts as a batch (vmap) give the same."""
    golden, tcfg, tparams, dcfg, params = setup
    ops, hidden = get_ops(), golden["target_hidden"]
    s1, s2 = int(golden["block1_start"]), int(golden["block2_start"])
    embed, head = target_embedding_and_head(tcfg, tparams)
    extend = jax.jit(extend_context, static_argnums=(0, 1))
    draft = jax.jit(draft_logits, static_argnums=(0, 1))
    ctx1 = extend(dcfg, ops, params, DraftContext.empty(dcfg, 16), jnp.asarray(hidden[:, :8]), s1)
    assert int(ctx1.length) == s1
    np.testing.assert_allclose(draft(dcfg, ops, params, ctx1, golden["block1_ids"][0], embed, head),
                               golden["logits1"], atol=TOL, rtol=0)
    ctx2 = extend(dcfg, ops, params, ctx1, jnp.asarray(hidden[:, s1:s2]), s2 - s1)
    np.testing.assert_allclose(draft(dcfg, ops, params, ctx2, golden["block2_ids"][0], embed, head),
                               golden["logits2"], atol=TOL, rtol=0)
    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), ctx1, ctx2)
    last = jnp.asarray([golden["block1_ids"][0], golden["block2_ids"][0]])
    batched = jax.vmap(lambda c, t: draft_logits(dcfg, ops, params, c, t, embed, head))(both, last)
    np.testing.assert_allclose(batched, np.stack([golden["logits1"], golden["logits2"]]), atol=TOL, rtol=0)


def test_bfloat16_drafter_follows_the_float32_goldens():
    """Published drafters are bfloat16: the whole path (target states included) in bfloat16 keeps the argmax
    drafts and stays within bfloat16 rounding of the float32 logits (measured 0.15 on logits up to ~18)."""
    golden = np.load(DATA / "golden" / "dflash.npz")
    tcfg = load_config(TARGET, "bfloat16")
    tparams = load_params(TARGET, tcfg, progress=False)
    dcfg = load_dflash_config(DRAFTER, "bfloat16")
    params = load_dflash_params(DRAFTER, dcfg)
    assert params["fc"].dtype == jnp.bfloat16
    states = target_layer_states(tcfg, get_ops(), tparams, golden["token_ids"], dcfg.target_layer_ids)
    embed, head = target_embedding_and_head(tcfg, tparams)
    for step in (1, 2):
        start = int(golden[f"block{step}_start"])
        logits = np.asarray(draft_logits_from_states(dcfg, get_ops(), params, states[:, :start],
                                                     golden[f"block{step}_ids"][0], embed, head))
        np.testing.assert_array_equal(logits.argmax(-1), golden[f"logits{step}"].argmax(-1))
        assert np.max(np.abs(logits - golden[f"logits{step}"])) < 0.5


def test_a_model_that_is_not_a_drafter_is_refused():
    with pytest.raises(ModelLoadError, match="not a DFlash drafter"):
        load_dflash_config(TARGET)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_dflash_config(DATA / "models" / "no-such-drafter")


def _edited_drafter(tmp_path, edit):
    out = tmp_path / "drafter"
    shutil.copytree(DRAFTER, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_missing_fields_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="mask_token_id"):
        load_dflash_config(_edited_drafter(tmp_path / "a", lambda c: c["dflash_config"].pop("mask_token_id")))
    with pytest.raises(ModelLoadError, match="lacks its 'dflash_config'"):
        load_dflash_config(_edited_drafter(tmp_path / "b", lambda c: c.pop("dflash_config")))
    with pytest.raises(ModelLoadError, match="DFlash drafter: config.json lacks the field 'vocab_size'"):
        load_dflash_config(_edited_drafter(tmp_path / "d", lambda c: c.pop("vocab_size")))
    with pytest.raises(ModelLoadError, match="sliding-window"):
        load_dflash_config(_edited_drafter(tmp_path / "c", lambda c: c.update(use_sliding_window=True)))


def test_weights_that_do_not_match_the_config_are_refused(tmp_path):
    path = _edited_drafter(tmp_path, lambda c: c.update(intermediate_size=80))
    with pytest.raises(ModelLoadError, match="has shape"):
        load_dflash_params(path, load_dflash_config(path))


def test_a_drafter_for_another_target_is_refused(setup):
    _, tcfg, _, dcfg, _ = setup
    with pytest.raises(ModelLoadError, match="does not fit the target: hidden size 64 against the target's 32"):
        check_drafter_fits(dcfg, dataclasses.replace(tcfg, hidden_size=32))
    with pytest.raises(ModelLoadError, match="vocabulary of 1063 against the target's 512"):
        check_drafter_fits(dcfg, dataclasses.replace(tcfg, vocab_size=512))
    with pytest.raises(ModelLoadError, match="made for 3 target layers"):
        check_drafter_fits(dcfg, dataclasses.replace(tcfg, num_layers=2))


def _trainer():
    pytest.importorskip("optax")
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_dflash", DATA.parents[1] / "tools" / "train_dflash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trainer_saves_the_published_format(tmp_path, setup):
    """tools/train_dflash.py's drafter reads back through the loader, tensor for tensor."""
    _, tcfg, _, _, _ = setup
    trainer = _trainer()
    args = type("Args", (), dict(target_layers=[0, 2], layers=2, block_size=5, mask_token_id=7, heads=4, kv_heads=2,
                                 head_dim=16, intermediate=48))()
    hf = trainer.drafter_hf_config(tcfg, args)
    dcfg = dflash_config_from_hf(hf)
    params = jax.tree.map(lambda a: a + jax.random.normal(jax.random.key(1), a.shape), random_dflash_params(dcfg, 0))
    trainer.save_drafter(hf, dcfg, params, tmp_path / "d")
    back_cfg = load_dflash_config(tmp_path / "d")
    assert back_cfg == dcfg and dcfg.target_layer_ids == (0, 2) and dcfg.num_drafts == 4
    check_drafter_fits(back_cfg, tcfg)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 load_dflash_params(tmp_path / "d", back_cfg), params)


def test_prompt_lookup_and_accepted_lengths():
    trainer = _trainer()
    seq = np.array([5, 6, 7, 8, 9, 5, 6, 7, 8, 4, 5, 6, 1, 2])
    assert trainer.ngram_proposal(seq, 7, 3) == [8, 9, 5]          # "5 6 7" seen at 0..2: what followed
    assert trainer.ngram_proposal(seq, 11, 3) == [7, 8, 4]         # "4 5 6" unseen, "5 6" last at 5..6
    assert trainer.ngram_proposal(seq, 12, 3) == []                # token 1 never seen before
    assert trainer.ngram_proposal(seq, 6, 9) == [7, 8, 9, 5, 6]    # only committed tokens are proposed
    # drafts all right, then one wrong, then none
    drafts = {2: [3, 4], 5: [6, 0], 7: [], 8: [9, 10]}
    assert trainer.accepted_lengths(np.arange(11), 2, 2, lambda c: drafts[c]) == [3, 2, 1, 3]
