"""Write the Hugging Face transformers reference ("golden") data for the parity tests.

Run from the repo root with the reference venv:

    .venv-ref/bin/python tools/make_goldens.py

It writes, deterministically (fixed seeds, CPU, float32, eager attention):

  tests/data/models/<name>/        tiny randomly initialised HF checkpoints
                                   (config.json, generation_config.json, model.safetensors)
  tests/data/golden/<name>.npz     prompt_{i} int32 [L_i], logits_{i} float32 [L_i, vocab],
                                   greedy_{i} int32 [32] for i in 0..3
  tests/data/golden/stories260k.json         greedy generation on the real stories260k model
  tests/data/golden/stories260k_logits.npz   prompt/logits pairs on stories260k

Each tiny model's eos_token_id is chosen *after* computing its greedy outputs with EOS
disabled: it is the smallest id >= 2 that never appears in any prompt or greedy output, so
plain greedy decoding (argmax, no min_new_tokens masking) yields exactly 32 tokens. The
script re-runs generate() with the saved generation config to confirm this.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
MODELS_DIR = DATA / "models"
GOLDEN_DIR = DATA / "golden"
STORIES = REPO.parent / "shared" / "models" / "stories260k"

PROMPT_LENS = (5, 11, 17, 24)
# The sliding-window models: prompts of 1-4x the window (their greedy continuations reach 6x).
SWA_WINDOW = 16
PROMPT_LENS_OF = {"mistral_swa": (17, 33, 48, 64), "qwen2_swa": (17, 33, 48, 64)}
# Seeds of their own, so that a family added to FAMILIES before them leaves their goldens as they are.
SEED_OF = {"mistral_swa": 2000, "qwen2_swa": 2001}
NEW_TOKENS = 32
MIN_MARGIN = 0.02  # smallest allowed top1-top2 logit gap along each greedy path
MIN_DISTINCT = 8  # greedy continuations must use at least this many distinct tokens
MAX_PROMPT_TRIES = 200
BOS_ID = 1

# Init scales applied after construction (HF's default std 0.02 gives near-flat logits).
LINEAR_STD = 0.2
EMBED_STD = 0.2
LM_HEAD_STD = 0.5  # untied output projection
TIED_STD = 0.5  # shared embedding/output matrix
BIAS_STD = 0.05
NORM_WEIGHT_STD = 0.2  # norm weights ~ 1 + N(0, 0.2)

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=BOS_ID,
    eos_token_id=2,  # placeholder; replaced by pick_eos_id() before saving
    pad_token_id=None,
)


# --------------------------------------------------------------------------- configs


def llama2_config() -> tuple[type, LlamaConfig]:
    """Llama-2 style: MHA, default rope, untied embeddings."""
    return LlamaForCausalLM, LlamaConfig(
        **COMMON,
        vocab_size=1000,
        num_key_value_heads=4,
        intermediate_size=172,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )


def llama3_config() -> tuple[type, LlamaConfig]:
    """Llama-3 style: GQA, llama3 rope scaling. With head_dim 16, theta 5e5 and original
    max positions 64, the 8 rotary frequencies cover all three llama3 regimes (kept,
    smoothly interpolated, divided by `factor`)."""
    return LlamaForCausalLM, LlamaConfig(
        **COMMON,
        vocab_size=1024,
        num_key_value_heads=2,
        intermediate_size=176,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    )


def mistral_config() -> tuple[type, MistralConfig]:
    """Mistral: GQA, no sliding window, untied."""
    return MistralForCausalLM, MistralConfig(
        **COMMON,
        vocab_size=1031,
        num_key_value_heads=2,
        intermediate_size=160,
        head_dim=16,
        rms_norm_eps=1e-5,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )


def qwen2_config() -> tuple[type, Qwen2Config]:
    """Qwen2: q/k/v biases, GQA, tied embeddings."""
    return Qwen2ForCausalLM, Qwen2Config(
        **COMMON,
        vocab_size=1048,
        num_key_value_heads=2,
        intermediate_size=144,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
        sliding_window=None,
        tie_word_embeddings=True,
    )


def qwen3_config() -> tuple[type, Qwen3Config]:
    """Qwen3: q/k RMSNorm, GQA, head_dim (32) != hidden/heads (16), tied embeddings."""
    return Qwen3ForCausalLM, Qwen3Config(
        **COMMON,
        vocab_size=1063,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
        sliding_window=None,
        tie_word_embeddings=True,
    )


def mistral_swa_config() -> tuple[type, MistralConfig]:
    """Mistral with a sliding window of 16 positions on every layer (prompts of 1-4x the window, and
    their generations, see past it)."""
    return MistralForCausalLM, MistralConfig(
        **COMMON,
        vocab_size=1031,
        num_key_value_heads=2,
        intermediate_size=160,
        head_dim=16,
        rms_norm_eps=1e-5,
        sliding_window=SWA_WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )


def qwen2_swa_config() -> tuple[type, Qwen2Config]:
    """Qwen2 with use_sliding_window: a window of 16 on the layers from max_window_layers (1) on, layer 0
    global (a window per layer)."""
    return Qwen2ForCausalLM, Qwen2Config(
        **COMMON,
        vocab_size=1048,
        num_key_value_heads=2,
        intermediate_size=144,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=True,
        sliding_window=SWA_WINDOW,
        max_window_layers=1,
        tie_word_embeddings=True,
    )


def qwen3_moe_config() -> tuple[type, Qwen3MoeConfig]:
    """Qwen3-MoE: 8 experts of width 32, 3 active a token, top-k weights not renormalised (norm_topk_prob
    False), q/k norms, untied."""
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **COMMON,
        vocab_size=1070,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    )


def mixtral_config() -> tuple[type, MixtralConfig]:
    """Mixtral: 4 experts of width 48, 2 active a token (weights renormalised), GQA, untied."""
    return MixtralForCausalLM, MixtralConfig(
        **COMMON,
        vocab_size=1077,
        num_key_value_heads=2,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    )


def phi3_config() -> tuple[type, transformers.Phi3Config]:
    """Phi-3 (mini, 128k style): fused qkv_proj and gate_up_proj, LongRoPE whose original length (64) no context
    here passes (the short factors, and the attention factor of 256 / 64), untied."""
    return transformers.Phi3ForCausalLM, transformers.Phi3Config(
        **COMMON,
        vocab_size=1097,
        num_key_value_heads=2,
        intermediate_size=112,
        rms_norm_eps=1e-5,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.2],
            "long_factor": [1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0, 24.0],
        },
        sliding_window=None,
        tie_word_embeddings=False,
    )


def phi4_mini_config() -> tuple[type, transformers.Phi3Config]:
    """Phi-4-mini style Phi-3: a partial rotary factor of 0.75 (12 of 16 dims), LongRoPE whose original length (4)
    every prompt here passes (the long factors from the first step, so transformers never recomputes its cache
    on crossing over), an explicit attention factor, tied."""
    return transformers.Phi3ForCausalLM, transformers.Phi3Config(
        **COMMON,
        vocab_size=1099,
        num_key_value_heads=2,
        intermediate_size=112,
        rms_norm_eps=1e-5,
        original_max_position_embeddings=4,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "attention_factor": 1.2,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.5, 2.5, 4.0, 6.0, 9.0, 13.0],
        },
        sliding_window=None,
        tie_word_embeddings=True,
    )


def apertus_config() -> tuple[type, transformers.ApertusConfig]:
    """Apertus: xIELU (its per-layer alpha_p, alpha_n, beta, eps), an MLP without a gate, q/k RMSNorm, llama3
    RoPE at Apertus' base, untied."""
    return _apertus_model, transformers.ApertusConfig(
        **COMMON,
        vocab_size=1103,
        num_key_value_heads=2,
        intermediate_size=160,
        rms_norm_eps=1e-5,
        hidden_act="xielu",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 12000000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    )


def _apertus_model(cfg) -> torch.nn.Module:
    """transformers 5.17's xIELU wants config.dtype as a torch dtype (the string write_family sets fails)."""
    cfg.dtype = torch.float32
    model = transformers.ApertusForCausalLM(cfg)
    cfg.dtype = "float32"
    return model


def gemma3_config() -> tuple[type, transformers.Gemma3TextConfig]:
    """Gemma 3 text: scaled embedding, (1 + w) RMSNorms (four a layer and on q/k), GeGLU, local (sliding) and
    global layers with their own RoPE (10k plain; 1M linear x2), query_pre_attn_scalar 24 (not head_dim 32),
    final logit softcapping. The window (64) is longer than any context here (24 + 32). Untied: with the scaled
    embedding tied to the head, these random layers' outputs are too small beside it and greedy repeats its input."""
    return transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        **COMMON,
        vocab_size=1109,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=24,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
        final_logit_softcapping=30.0,
        attn_logit_softcapping=None,
        tie_word_embeddings=False,
    )


def gpt2_config() -> tuple[type, GPT2Config]:
    """GPT-2: learned positions, LayerNorm, gelu_new, Conv1D weights, tied.
    n_inner=None (=4*n_embd=256) like every real GPT-2 checkpoint."""
    return GPT2LMHeadModel, GPT2Config(
        vocab_size=1091,
        n_positions=256,
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_inner=None,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=BOS_ID,
        eos_token_id=2,
        pad_token_id=None,
        tie_word_embeddings=True,
    )


FAMILIES = {
    "llama2": llama2_config,
    "llama3": llama3_config,
    "mistral": mistral_config,
    "qwen2": qwen2_config,
    "qwen3": qwen3_config,
    "gpt2": gpt2_config,
    "mistral_swa": mistral_swa_config,
    "qwen2_swa": qwen2_swa_config,
    "qwen3_moe": qwen3_moe_config,
    "mixtral": mixtral_config,
}
SEED_OF.update({"qwen3_moe": 3000, "mixtral": 3001})
FAMILIES.update(phi3=phi3_config, phi4_mini=phi4_mini_config, apertus=apertus_config, gemma3=gemma3_config)
SEED_OF.update({"phi3": 4000, "apertus": 4001, "gemma3": 4002, "phi4_mini": 4003})


# --------------------------------------------------------------------------- helpers


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


def is_norm(name: str, module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.LayerNorm) or "norm" in type(module).__name__.lower()


@torch.no_grad()
def rescale_init(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Re-draw every parameter with larger scales so logits are far from uniform."""
    tied = model.config.tie_word_embeddings
    # Gemma's RMSNorms scale by 1 + w, so its checkpoints hold w near 0: drawn as 1 + N(0, 0.2) they would scale by
    # ~2 at each of a layer's six norms and leave float32 logits no digits to agree in at 1e-4
    norm_offset = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    emb_in = model.get_input_embeddings()
    emb_out = model.get_output_embeddings()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if module is emb_out:
                if not tied:  # when tied, drawn once below via the input embedding
                    p.copy_(LM_HEAD_STD * torch.randn(p.shape, generator=gen))
            elif module is emb_in:
                p.copy_((TIED_STD if tied else EMBED_STD) * torch.randn(p.shape, generator=gen))
            elif is_norm(mod_name, module):
                if p_name == "weight":
                    p.copy_(norm_offset + NORM_WEIGHT_STD * torch.randn(p.shape, generator=gen))
                else:  # LayerNorm bias
                    p.copy_(BIAS_STD * torch.randn(p.shape, generator=gen))
            elif isinstance(module, torch.nn.Embedding):
                p.copy_(EMBED_STD * torch.randn(p.shape, generator=gen))
            elif p_name == "bias":
                p.copy_(BIAS_STD * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(LINEAR_STD * torch.randn(p.shape, generator=gen))
    if tied:
        assert emb_out.weight is emb_in.weight


@torch.no_grad()
def forward_logits(model, ids: list[int] | np.ndarray) -> np.ndarray:
    x = torch.tensor(np.asarray(ids, dtype=np.int64))[None]
    return model(input_ids=x).logits[0].float().numpy()


@torch.no_grad()
def greedy(model, ids, gen_cfg: GenerationConfig) -> np.ndarray:
    x = torch.tensor(np.asarray(ids, dtype=np.int64))[None]
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gen_cfg)
    return out[0, x.shape[1] :].numpy()


def greedy_config(max_new: int, eos_token_id, **kw) -> GenerationConfig:
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos_token_id,
        bos_token_id=BOS_ID,
        pad_token_id=kw.pop("pad_token_id", eos_token_id if eos_token_id is not None else 0),
        use_cache=True,
        **kw,
    )


def argmax_margin(logits: np.ndarray) -> float:
    """Smallest gap between the top-1 and top-2 logit over the rows."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return float((top2[:, 1] - top2[:, 0]).min())


def pick_eos_id(vocab: int, used: set[int]) -> int:
    for i in range(2, vocab):
        if i not in used:
            return i
    raise RuntimeError("no free id for EOS")


def dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def print_tensors(path: Path) -> None:
    with safe_open(str(path), framework="pt") as f:
        for k in sorted(f.keys()):
            t = f.get_slice(k)
            print(f"    {k:45s} {t.get_dtype():8s} {list(t.get_shape())}")


# --------------------------------------------------------------------------- writers


def write_family(name: str, seed: int) -> None:
    """Build one tiny model, save it, and write its golden npz."""
    seed_all(seed)
    cls, cfg = FAMILIES[name]()
    cfg._attn_implementation = "eager"
    cfg.dtype = "float32"
    model = cls(cfg).to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(seed)
    rescale_init(model, gen)

    vocab = cfg.vocab_size
    rng = np.random.default_rng(seed)
    # Greedy with EOS disabled: pure argmax decoding for exactly NEW_TOKENS steps.
    # Prompts are redrawn (deterministically) until every greedy step has a clear argmax,
    # so an fp32 engine whose logits differ by ~1e-4 still reproduces the tokens exactly.
    # (eos_token_id=None in a GenerationConfig means "inherit", so clear it on the model too.)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    no_eos = greedy_config(NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    arrays: dict[str, np.ndarray] = {}
    used: set[int] = set()
    prompts = []
    for i, n in enumerate(PROMPT_LENS_OF.get(name, PROMPT_LENS)):
        for attempt in range(MAX_PROMPT_TRIES):
            p = rng.integers(3, vocab, size=n).astype(np.int32)
            toks = greedy(model, p, no_eos).astype(np.int32)
            assert toks.shape == (NEW_TOKENS,), toks.shape
            # Cross-check: a no-cache forward over prompt+continuation gives the same argmaxes.
            full = forward_logits(model, np.concatenate([p, toks[:-1]]))
            assert np.array_equal(full[n - 1 :].argmax(-1), toks), f"{name}: cache/no-cache mismatch"
            margin = argmax_margin(full[n - 1 :])
            if margin >= MIN_MARGIN and len(set(toks.tolist())) >= MIN_DISTINCT:
                break
        else:
            raise RuntimeError(f"{name}: no prompt of length {n} met the margin/diversity bar")
        logits = forward_logits(model, p)
        prompts.append(p)
        arrays[f"prompt_{i}"] = p
        arrays[f"logits_{i}"] = logits.astype(np.float32)
        arrays[f"greedy_{i}"] = toks
        used |= set(p.tolist()) | set(toks.tolist())
        print(
            f"  [{name}] prompt_{i} len={n:2d} tries={attempt + 1} logits std={logits.std():.2f} "
            f"distinct greedy={len(set(toks.tolist())):2d} min top1-top2 margin={margin:.3f}"
        )

    eos = pick_eos_id(vocab, used)
    model.config.eos_token_id = eos
    model.generation_config = greedy_config(NEW_TOKENS, eos_token_id=eos, pad_token_id=None)
    model.generation_config.max_new_tokens = None  # keep generation_config.json generic
    model.generation_config.max_length = None

    # Re-check with normal EOS handling: identical 32 tokens.
    for i, p in enumerate(prompts):
        cfg_eos = greedy_config(NEW_TOKENS, eos_token_id=eos)
        assert np.array_equal(greedy(model, p, cfg_eos), arrays[f"greedy_{i}"]), f"{name}: EOS changed output"

    out_dir = MODELS_DIR / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir)  # transformers 5 always writes safetensors
    st = out_dir / "model.safetensors"
    assert st.is_file(), "expected a single model.safetensors"

    # Reload from disk and confirm the saved checkpoint reproduces the logits bit-for-bit.
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(forward_logits(reloaded, p), arrays[f"logits_{i}"])

    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    np.savez(GOLDEN_DIR / f"{name}.npz", **arrays)

    size = dir_size(out_dir)
    assert size < 1.5e6, f"{name}: model folder too large ({size} bytes)"
    print(f"  [{name}] eos_token_id={eos}  folder={size / 1e6:.3f} MB")
    print(f"  [{name}] config.json:")
    print("    " + (out_dir / "config.json").read_text().replace("\n", "\n    "))
    print(f"  [{name}] generation_config.json: {json.loads((out_dir / 'generation_config.json').read_text())}")
    print(f"  [{name}] safetensors tensors:")
    print_tensors(st)


def write_stories260k() -> None:
    """Goldens on the real trained stories260k checkpoint (read-only, from ../shared)."""
    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32, attn_implementation="eager").eval()
    eos = model.config.eos_token_id
    assert tok.bos_token_id == 1 and eos == 2

    prompt = "Once upon a time"
    ids = tok(prompt)["input_ids"]
    assert ids[0] == 1, ids

    seq = greedy(model, ids, greedy_config(200, eos_token_id=eos)).tolist()
    # generate() pads finished rows with pad_token_id; batch 1 stops right after EOS, so the
    # sequence ends at (and includes) the EOS token if one was produced.
    stopped = eos in seq
    if stopped:
        assert seq.index(eos) == len(seq) - 1
    no_eos = greedy(model, ids, greedy_config(200, eos_token_id=eos, min_new_tokens=200)).tolist()
    assert len(no_eos) == 200 and eos not in no_eos

    # Smallest top1-top2 gap along the greedy path (no-cache forward): a hint for how much
    # numerical slack an engine has before its greedy tokens can legitimately diverge.
    full = forward_logits(model, ids + seq[:-1])[len(ids) - 1 :]
    assert np.array_equal(full.argmax(-1), seq), "stories260k: cache/no-cache mismatch"
    gaps = np.diff(np.sort(full, axis=-1)[:, -2:], axis=-1)[:, 0]

    golden = {
        "prompt": prompt,
        "prompt_ids": ids,
        "greedy_ids": seq,
        "stopped_at_eos": stopped,
        "greedy_text": tok.decode(seq, skip_special_tokens=True),
        "greedy_ids_no_eos": no_eos,
        "greedy_min_top2_margin": round(float(gaps.min()), 6),
        "greedy_min_top2_margin_step": int(gaps.argmin()),
        "no_eos_method": "min_new_tokens=200 (EOS logit set to -inf until 200 tokens)",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    (GOLDEN_DIR / "stories260k.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"  [stories260k] prompt_ids={ids} new={len(seq)} stopped_at_eos={stopped}")
    print(f"  [stories260k] text: {golden['greedy_text']!r}")
    print(f"  [stories260k] greedy_ids_no_eos == greedy_ids: {no_eos == seq}; "
          f"min top1-top2 margin {gaps.min():.4f} at step {gaps.argmin()}")

    arrays = {}
    for i, text in enumerate(["Once upon a time there was", "The little dog ran to the park and"]):
        p = np.asarray(tok(text)["input_ids"], dtype=np.int32)
        arrays[f"prompt_{i}"] = p
        arrays[f"logits_{i}"] = forward_logits(model, p).astype(np.float32)
        print(f"  [stories260k] logits prompt_{i} {text!r} ids={p.tolist()}")
    np.savez(GOLDEN_DIR / "stories260k_logits.npz", **arrays)


def main() -> None:
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    torch.use_deterministic_algorithms(True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    only = set(sys.argv[1:])   # family names: write only those (the others' files stay as they are)
    if only - set(FAMILIES) - {"stories260k"}:
        raise SystemExit(f"unknown families {sorted(only - set(FAMILIES))}: {', '.join(FAMILIES)}, stories260k")
    for seed, name in enumerate(FAMILIES):
        if only and name not in only:
            continue
        print(f"== {name}")
        write_family(name, seed=SEED_OF.get(name, 1000 + seed))
    if not only or "stories260k" in only:
        print("== stories260k")
        write_stories260k()
    # (tests/data/models also holds other scripts' checkpoints: only this script's folders count)
    ours = sum(dir_size(MODELS_DIR / name) for name in FAMILIES if (MODELS_DIR / name).is_dir()) + sum(
        f.stat().st_size for f in GOLDEN_DIR.iterdir() if f.stem in FAMILIES or f.stem.startswith("stories260k")
    )
    print(f"written by this script: {ours / 1e6:.3f} MB; tests/data total: {dir_size(DATA) / 1e6:.3f} MB")
    assert ours < 24e6, "golden data too large"


if __name__ == "__main__":
    main()
