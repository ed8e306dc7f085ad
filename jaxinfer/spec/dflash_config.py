"""DFlashConfig and weights: a DFlash block drafter's folder (z-lab's published format) read into a config and
a parameter pytree.

A drafter folder holds a Qwen3-shaped config.json with `architectures: ["DFlashDraftModel"]`, `block_size`
(top level, or inside `dflash_config` in later releases), `num_target_layers`, and `dflash_config`
{`mask_token_id`, `target_layer_ids`}; and model.safetensors with `fc.weight` [D, n*D], `hidden_norm.weight`,
`norm.weight` and `layers.{i}.*` named as a Qwen3 decoder layer's. It has no embedding and no lm_head: it
uses the target's.

Our tree: fc [D, n*D]; hidden_norm [D]; norm [D]; layers: the per-layer subset of model.weights' tree
(attn_norm.scale, wqkv [L, Q+2K, D], bqkv?, q_norm, k_norm, wo, bo?, mlp_norm.scale, w_gate_up, w_down).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxinfer.errors import ModelLoadError
from jaxinfer.model.config import ModelConfig, config_from_hf, read_json
from jaxinfer.model.weights import LLAMA_RULES, CheckpointReader

ARCHITECTURE = "DFlashDraftModel"


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    model: ModelConfig                # the drafter's own layers (Qwen3 fields); vocab_size is its target's
    block_size: int                   # query positions a pass: the last committed token + block_size - 1 masks
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # target layers whose outputs (hidden_states[l + 1]) are the context
    num_target_layers: int

    @property
    def num_drafts(self) -> int:
        """Tokens one pass drafts (the block's positions after its first)."""
        return self.block_size - 1


def authors_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The layers the authors pick when a config names none (their build_target_layer_ids): evenly from
    layer 1 to layer num_target_layers - 3, or the middle layer for a one-layer drafter."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def dflash_config_from_hf(hf: dict[str, Any], dtype: str = "auto") -> DFlashConfig:
    """A DFlashConfig from the dict of a drafter's config.json; dtype "auto": the checkpoint's."""
    archs = hf.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise ModelLoadError(f"not a DFlash drafter: architectures {archs} (a drafter's is [{ARCHITECTURE!r}])")
    extra = hf.get("dflash_config")
    if not isinstance(extra, dict):
        raise ModelLoadError("DFlash drafter config.json lacks its 'dflash_config' object")
    if any(t == "sliding_attention" for t in hf.get("layer_types") or ()) or hf.get("use_sliding_window"):
        raise ModelLoadError("DFlash drafters with sliding-window layers are not supported")
    block_size = hf.get("block_size", extra.get("block_size"))
    missing = [name for name, value in (("block_size", block_size), ("dflash_config.mask_token_id",
                                        extra.get("mask_token_id")), ("num_hidden_layers", hf.get("num_hidden_layers")))
               if value is None]
    layer_ids = extra.get("target_layer_ids")
    if layer_ids is None and hf.get("num_target_layers") is None:
        missing.append("dflash_config.target_layer_ids (or num_target_layers)")
    if missing:
        raise ModelLoadError(f"DFlash drafter config.json lacks {', '.join(missing)}")
    try:
        model = config_from_hf({**hf, "architectures": ["Qwen3ForCausalLM"]}, dtype)
    except ModelLoadError as e:
        raise ModelLoadError(f"DFlash drafter: {e}") from None
    # the authors' attention takes attention_bias for all four projections (a Qwen3 target's o_proj has none)
    model = dataclasses.replace(model, o_bias=model.qkv_bias)
    num_target = int(hf.get("num_target_layers") or 1 + max(layer_ids))
    if layer_ids is None:
        layer_ids = authors_target_layer_ids(num_target, model.num_layers)
    cfg = DFlashConfig(model=model, block_size=int(block_size), mask_token_id=int(extra["mask_token_id"]),
                       target_layer_ids=tuple(int(i) for i in layer_ids), num_target_layers=num_target)
    if cfg.block_size < 2:
        raise ModelLoadError(f"DFlash block_size must be at least 2, got {cfg.block_size}")
    if not cfg.target_layer_ids or min(cfg.target_layer_ids) < 0:
        raise ModelLoadError(f"bad DFlash target_layer_ids {list(cfg.target_layer_ids)}")
    return cfg


def load_dflash_config(drafter_dir: str | Path, dtype: str = "auto") -> DFlashConfig:
    """Read a drafter folder's config.json."""
    if not Path(drafter_dir).is_dir():
        raise ModelLoadError(f"drafter folder {drafter_dir} does not exist")
    return dflash_config_from_hf(read_json(Path(drafter_dir) / "config.json"), dtype)


def check_drafter_fits(dcfg: DFlashConfig, target: ModelConfig) -> None:
    """One clear error where the drafter was not made for this target (its states and vocabulary)."""
    problems = []
    if dcfg.model.hidden_size != target.hidden_size:
        problems.append(f"hidden size {dcfg.model.hidden_size} against the target's {target.hidden_size}")
    if dcfg.model.vocab_size != target.vocab_size:
        problems.append(f"vocabulary of {dcfg.model.vocab_size} against the target's {target.vocab_size}")
    if not 0 <= dcfg.mask_token_id < target.vocab_size:
        problems.append(f"mask token {dcfg.mask_token_id} outside the target's vocabulary")
    if dcfg.num_target_layers != target.num_layers or max(dcfg.target_layer_ids) >= target.num_layers:
        problems.append(f"made for {dcfg.num_target_layers} target layers (reads {list(dcfg.target_layer_ids)}), "
                        f"the target has {target.num_layers}")
    if problems:
        raise ModelLoadError("the DFlash drafter does not fit the target: " + "; ".join(problems))


def random_dflash_params(dcfg: DFlashConfig, seed: int = 0, std: float = 0.02) -> dict:
    """Our tree drawn as the authors' post_init draws it (linears N(0, std), norms 1), in float32 and then in
    dcfg.model's dtype: an untrained drafter for the trainer, the tests and the benchmarks."""
    import jax.numpy as jnp

    cfg, n = dcfg.model, len(dcfg.target_layer_ids)
    d, L, i = cfg.hidden_size, cfg.num_layers, cfg.intermediate_size
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    normal = lambda shape: (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(cfg.jnp_dtype)
    ones = lambda shape: jnp.ones(shape, cfg.jnp_dtype)
    return {"fc": normal((d, n * d)), "hidden_norm": ones((d,)), "norm": ones((d,)), "layers": {
        "attn_norm": {"scale": ones((L, d))}, "mlp_norm": {"scale": ones((L, d))},
        "wqkv": normal((L, cfg.q_size + 2 * cfg.kv_size, d)), "q_norm": ones((L, cfg.head_dim)),
        "k_norm": ones((L, cfg.head_dim)), "wo": normal((L, d, cfg.q_size)),
        "w_gate_up": normal((L, 2 * i, d)), "w_down": normal((L, d, i))}}


def load_dflash_params(drafter_dir: str | Path, dcfg: DFlashConfig) -> dict:
    """Read a drafter folder's weights into our tree (module docstring), checked against dcfg, on the default
    device in dcfg.model's dtype."""
    drafter_dir = Path(drafter_dir)
    reader = CheckpointReader(drafter_dir)
    cfg = dcfg.model
    dtype = np.dtype(cfg.jnp_dtype)

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in reader:
            raise ModelLoadError(f"{drafter_dir}: tensor {name!r} is missing from the drafter")
        arr = reader.get(name)
        if tuple(arr.shape) != tuple(shape):
            raise ModelLoadError(f"{drafter_dir}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}")
        return arr.astype(dtype)

    d, n = cfg.hidden_size, len(dcfg.target_layer_ids)
    tree: dict = {"fc": read("fc.weight", (d, n * d)), "hidden_norm": read("hidden_norm.weight", (d,)),
                  "norm": read("norm.weight", (d,)), "layers": {}}
    # a Qwen3 target's per-layer map, without its "model." prefix
    for rule in LLAMA_RULES:
        if not (rule.per_layer and rule.when(cfg)):
            continue
        sources = [s.removeprefix("model.") for s in rule.sources]
        stacked = np.stack([np.concatenate([read(s.format(i=i), shape) for s, shape in zip(sources, rule.shapes(cfg))])
                            for i in range(cfg.num_layers)])
        *parents, leaf = rule.dest.removeprefix("layers.").split(".")
        node = tree["layers"]
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = stacked
    return jax.device_put(tree)
