"""Write the DFlash drafter's reference ("golden") data from the authors' own implementation.

Run from the repo root with the reference venv, giving the folder that holds the authors' `model.py`
(z-lab/dflash, `dflash/model.py`; it is imported from there, nothing of it is copied here):

    .venv-ref/bin/python tools/make_dflash_golden.py /path/to/z-lab-dflash/dflash

It writes, deterministically (fixed seeds, CPU, float32, eager attention):

  tests/data/models/dflash-tiny/   a randomly initialised DFlash drafter for the tiny Qwen3 target
                                   tests/data/models/qwen3, saved as the authors publish drafters
                                   (config.json with dflash_config + model.safetensors)
  tests/data/golden/dflash.npz     token_ids int32 [T]; target_hidden float32 [n, T, D] (the target's
                                   hidden_states[l + 1] for each l of target_layer_ids, as the authors'
                                   extract_context_feature reads them); two drafting steps as the authors'
                                   dflash_generate runs them with its draft KV cache:
                                   block{s}_ids int32 [block_size], block{s}_start int32 (the block's first
                                   position = context length), logits{s} float32 [block_size - 1, V]

Step 1 drafts from the context features of positions 0..start1-1; the cache is then cropped to start1 and
step 2 adds the features of positions start1..start2-1 only (the accepted tokens), so the golden also pins
down what the drafter keeps between steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "tests" / "data" / "models" / "qwen3"
OUT_MODEL = REPO / "tests" / "data" / "models" / "dflash-tiny"
OUT_GOLDEN = REPO / "tests" / "data" / "golden" / "dflash.npz"

SEED = 1234
BLOCK_SIZE = 4
TARGET_LAYER_IDS = [0, 2]   # the tiny target has 3 layers; 2 is its last (transformers norms that state)
START1, START2 = 7, 10      # step 1's context length; step 2's, after 2 drafts and the target's token
NORM_WEIGHT_STD = 0.2


def load_authors_module(code_dir: Path):
    path = code_dir / "model.py"
    if not path.is_file():
        sys.exit(f"{path} not found: give the folder that holds the authors' dflash/model.py")
    spec = importlib.util.spec_from_file_location("dflash_reference_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def drafter_config(target_cfg) -> Qwen3Config:
    cfg = Qwen3Config(
        vocab_size=target_cfg.vocab_size,
        hidden_size=target_cfg.hidden_size,     # the drafter lives in the target's embedding space
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        block_size=BLOCK_SIZE,
        num_target_layers=target_cfg.num_hidden_layers,
        dflash_config={"mask_token_id": target_cfg.vocab_size - 1, "target_layer_ids": TARGET_LAYER_IDS},
        auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        dtype="float32",
    )
    cfg.architectures = ["DFlashDraftModel"]
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Linear weights at 1/sqrt(fan_in) and norm scales around 1, so that every term moves the logits."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + NORM_WEIGHT_STD * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("code_dir", type=Path, help="folder holding the authors' model.py (z-lab/dflash's dflash/)")
    args = ap.parse_args()
    ref = load_authors_module(args.code_dir)
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)

    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32, attn_implementation="eager").eval()
    model = ref.DFlashDraftModel(drafter_config(target.config)).eval()
    randomize(model, gen)
    assert model.target_layer_ids == TARGET_LAYER_IDS and model.block_size == BLOCK_SIZE
    mask_id = model.mask_token_id

    T = START2 + 2
    token_ids = torch.randint(3, target.config.vocab_size - 1, (T,), generator=gen)
    out = target(token_ids[None], output_hidden_states=True)
    features = ref.extract_context_feature(out.hidden_states, model.target_layer_ids)   # [1, T, n * D]
    per_layer = np.stack([out.hidden_states[l + 1][0].numpy() for l in model.target_layer_ids])

    cache = DynamicCache()
    arrays = {"token_ids": token_ids.numpy().astype(np.int32), "target_hidden": per_layer.astype(np.float32)}
    ctx_from = 0
    for step, start in ((1, START1), (2, START2)):
        block = torch.full((1, BLOCK_SIZE), mask_id, dtype=torch.long)
        block[0, 0] = token_ids[start]
        hidden = model(target_hidden=features[:, ctx_from:start], noise_embedding=target.model.embed_tokens(block),
                       position_ids=torch.arange(ctx_from, start + BLOCK_SIZE)[None], past_key_values=cache,
                       use_cache=True, is_causal=False)
        logits = target.lm_head(hidden[:, 1 - BLOCK_SIZE:, :])[0]
        cache.crop(start)
        ctx_from = start
        arrays[f"block{step}_ids"] = block[0].numpy().astype(np.int32)
        arrays[f"block{step}_start"] = np.int32(start)
        arrays[f"logits{step}"] = logits.float().numpy()

    # The cached step 2 equals one pass over all of its context (what a recomputing drafter does).
    fresh = model(target_hidden=features[:, :START2],
                  noise_embedding=target.model.embed_tokens(torch.tensor(arrays["block2_ids"], dtype=torch.long)[None]),
                  position_ids=torch.arange(0, START2 + BLOCK_SIZE)[None], is_causal=False)
    np.testing.assert_allclose(target.lm_head(fresh[:, 1 - BLOCK_SIZE:])[0].numpy(), arrays["logits2"], atol=1e-5)

    if OUT_MODEL.exists():
        shutil.rmtree(OUT_MODEL)
    model.save_pretrained(OUT_MODEL)
    for extra in OUT_MODEL.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()
    OUT_GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    np.savez(OUT_GOLDEN, **arrays)
    cfg = json.loads((OUT_MODEL / "config.json").read_text())
    size = sum(p.stat().st_size for p in OUT_MODEL.iterdir())
    print(f"wrote {OUT_MODEL} ({size} bytes; architectures {cfg['architectures']}) and {OUT_GOLDEN} "
          f"({OUT_GOLDEN.stat().st_size} bytes)")
    for k, v in arrays.items():
        print(f"  {k}: {np.shape(v)} {np.asarray(v).dtype}")


if __name__ == "__main__":
    main()
