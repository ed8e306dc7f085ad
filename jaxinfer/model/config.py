"""ModelConfig: one frozen (hashable) record per model, read from a Hugging Face config.json.

Every supported family is the same forward function; the differences are the fields below.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxinfer.errors import ModelLoadError

if TYPE_CHECKING:
    import jax

# Hugging Face `architectures[0]` -> our family name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GPT2LMHeadModel": "gpt2",
    "Phi3ForCausalLM": "phi3",
    "ApertusForCausalLM": "apertus",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str                      # "llama" | "qwen2" | "qwen3" | "gpt2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_kind: str = "rms"           # "rms" | "layer"
    norm_eps: float = 1e-6
    position_kind: str = "rope"      # "rope" | "learned"
    rope_theta: float = 10000.0
    # Llama-3 style frequency scaling: (factor, low_freq_factor, high_freq_factor, original_max_pos).
    rope_llama3: tuple[float, float, float, int] | None = None
    rope_linear_factor: float = 1.0
    mlp_kind: str = "swiglu"         # "swiglu" | "gelu" | "geglu" (gelu_tanh(gate) * up) | "xielu" (no gate)
    activation: str = "silu"         # "silu" | "gelu_tanh" | "gelu" | "xielu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    # Sliding-window attention, one entry a layer (empty: every layer global): a token at position p sees the
    # keys at positions in (p - window, p]; 0 is a global layer.
    layer_windows: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"           # compute and storage dtype of the parameters
    # Mixture of experts (every layer's MLP is one): experts a layer, active a token, each expert's SwiGLU
    # width, and whether the top-k routing weights are renormalised to sum to 1 (Mixtral always does).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Dense families' differences (Phi-3/4, Apertus, Gemma 3); the defaults are Llama's.
    rope_partial: float = 1.0        # share of head_dim that RoPE rotates (partial_rotary_factor); the rest passes
    # LongRoPE (Phi-3): per-frequency divisors for short and for long contexts, original_max_position_embeddings
    # (a sequence longer than it takes the long ones) and the attention factor on cos and sin.
    rope_longrope: tuple[tuple[float, ...], tuple[float, ...], int, float] | None = None
    # Gemma 3: plain RoPE at base rope_local_theta on the layers marked True (its sliding-attention layers)
    rope_local_theta: float = 0.0
    rope_local_layers: tuple[bool, ...] = ()
    # Gemma 3: query_pre_attn_scalar ** -0.5 as the score scale (0: head_dim ** -0.5); weights.py folds the ratio of
    # the two into q_norm's weight, so that the attention ops keep head_dim ** -0.5
    query_scale: float = 0.0
    embed_scale: float = 1.0         # Gemma 3: the embedding times sqrt(hidden_size), in the model's dtype
    sandwich_norms: bool = False     # Gemma 3: RMSNorm also on the attention's and the MLP's outputs
    final_logit_softcap: float = 0.0  # logits = c * tanh(logits / c) (0: none)

    @property
    def rotary_dim(self) -> int:
        """Head dims that RoPE rotates (all but for a partial rotary factor)."""
        return int(self.head_dim * self.rope_partial)

    @property
    def has_windows(self) -> bool:
        """Whether any layer attends over a sliding window."""
        return any(self.layer_windows)

    @property
    def kv_window(self) -> int:
        """The most positions any layer's query sees where every layer has a window (the largest window): the
        K/V behind it are never read again. 0 where some layer is global."""
        return max(self.layer_windows) if self.layer_windows and all(self.layer_windows) else 0

    def window_of(self, layer: int | jax.Array) -> jax.Array | None:
        """The window of `layer` (a traced index is fine) as an int32 scalar (0: global), or None where no layer
        has a window, so that a model without windows traces no window at all."""
        import jax.numpy as jnp

        if not self.has_windows:
            return None
        return jnp.asarray(self.layer_windows, jnp.int32)[layer]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    def rope_inv_freq(self, long: bool = False, theta: float | None = None) -> np.ndarray:
        """Inverse frequencies [head_dim // 2] in float32, scaled as the config asks (long: LongRoPE's long
        factors; theta: plain RoPE at that base instead). With a partial rotary factor, the rotated dims'
        frequencies and then zeros (cos 1, sin 0): model/rotary.py orders each head's q/k rows so that the
        dims that pass come last in each half."""
        # float32 throughout, as transformers computes it, so that angles agree to the last bit.
        dim = self.rotary_dim if theta is None else self.head_dim
        exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        base = np.float32(self.rope_theta if theta is None else theta) ** exponent
        if self.rope_longrope is not None and theta is None:
            base = np.asarray(self.rope_longrope[1 if long else 0], np.float32) * base
        inv = (np.float32(1.0) / base).astype(np.float32)
        if theta is not None:
            return inv
        inv = inv / np.float32(self.rope_linear_factor)
        if self.rope_llama3 is not None:
            factor, low, high, old_len = self.rope_llama3
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            mid = (1 - smooth) * scaled / factor + smooth * scaled
            is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(is_mid, mid, scaled)
        return np.pad(inv.astype(np.float32), (0, self.head_dim // 2 - dim // 2))

    def num_params(self) -> int:
        d, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d
        mlp = (3 if self.mlp_kind in ("swiglu", "geglu") else 2) * d * i
        if self.num_experts:   # every expert's, and the router
            mlp = self.num_experts * (3 * d * self.moe_intermediate_size + d)
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        pos = self.max_position_embeddings * d if self.position_kind == "learned" else 0
        return L * (attn + mlp) + emb + pos

    def active_params(self, experts: float | None = None) -> float:
        """The parameters a token's pass multiplies by: num_params with `experts` experts a layer (default
        num_experts_per_tok; a batch's expected distinct experts, say) in place of all of a mixture's."""
        if not self.num_experts:
            return self.num_params()
        unused = self.num_experts - (self.num_experts_per_tok if experts is None else experts)
        return self.num_params() - self.num_layers * unused * 3 * self.hidden_size * self.moe_intermediate_size


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a model folder's file; one clear ModelLoadError for a missing or malformed one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_fields(hf: dict[str, Any], phi3: bool = False) -> dict[str, Any]:
    """RoPE settings from either transformers 5 `rope_parameters` or older `rope_theta`/`rope_scaling`. phi3:
    Phi-3's own readings too (LongRoPE, which it also calls "su" and "yarn"; a partial rotary factor)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": theta}
    if kind in (None, "default"):
        pass
    elif kind == "llama3":
        out["rope_llama3"] = (
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    elif kind == "linear":
        out["rope_linear_factor"] = float(params["factor"])
    elif phi3 and kind in ("longrope", "su", "yarn"):
        out["rope_longrope"] = _longrope(hf, params)
    else:
        raise ModelLoadError(f"unsupported rope type {kind!r}")
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        if not phi3:
            raise ModelLoadError("partial rotary embeddings are not supported")
        out["rope_partial"] = partial
    return out


def _longrope(hf: dict[str, Any], params: dict[str, Any]) -> tuple:
    """(short factors, long factors, original_max_position_embeddings, attention factor) as transformers'
    _compute_longrope_parameters reads them (Phi-3 keeps the original length beside rope_parameters)."""
    orig = int(hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
               or hf["max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = int(hf["max_position_embeddings"]) / orig
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return (tuple(float(f) for f in params["short_factor"]), tuple(float(f) for f in params["long_factor"]), orig,
            float(attention))


def _layer_windows(hf: dict[str, Any], arch: str) -> tuple[int, ...]:
    """Each layer's sliding window as transformers applies it (0: global; () where every layer is global).
    Mistral: `sliding_window` on every layer. Qwen2/Qwen3: only with `use_sliding_window`, on the layers that
    `layer_types` calls "sliding_attention" (by default those from `max_window_layers` on). Llama ignores the
    field, as transformers' Llama does. Mixtral, and Qwen3-MoE with `use_sliding_window`: on every layer. A window as
    long as the positions the model takes never bites: 0."""
    n = int(hf["num_hidden_layers"])
    if arch in ("MistralForCausalLM", "MixtralForCausalLM") or (arch == "Qwen3MoeForCausalLM" and
                                                              hf.get("use_sliding_window", False)):
        sliding = [True] * n
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window", False):
        types = hf.get("layer_types")
        if types is None:
            first = int(hf.get("max_window_layers", 28))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ModelLoadError(f"layer_types {types!r}: want {n} of 'sliding_attention' / 'full_attention'")
        sliding = [t == "sliding_attention" for t in types]
    else:
        return ()
    window = _window_size(hf.get("sliding_window"), int(hf.get("max_position_embeddings", 2048)))
    windows = tuple(window if s else 0 for s in sliding)
    return windows if any(windows) else ()


def _window_size(window: Any, max_pos: int) -> int:
    """config.json's sliding_window as a layer's window: 0 where it never bites (none, or as long as the positions
    the model takes); one clear error for one that is not a positive number of positions."""
    if window in (None, 0):
        return 0
    if int(window) < 1:
        raise ModelLoadError(f"sliding_window {window!r}: want a positive number of positions")
    return 0 if int(window) >= max_pos else int(window)


def _moe_fields(family: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The expert fields of a mixture-of-experts family (none for a dense one). Every layer must be sparse:
    Qwen3-MoE's dense layers (`mlp_only_layers`, `decoder_sparse_step` > 1) would need a second MLP stack."""
    if family not in ("qwen3_moe", "mixtral"):
        return {}
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if family == "qwen3_moe":
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = sorted(set(hf.get("mlp_only_layers") or []) |
                       {i for i in range(int(hf["num_hidden_layers"])) if (i + 1) % step})
        if dense or experts == 0:
            raise ModelLoadError(f"Qwen3-MoE with dense layers ({dense or 'num_experts 0'}: mlp_only_layers / "
                                 f"decoder_sparse_step) is not supported; every layer must be a mixture of experts")
    top_k = int(hf["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise ModelLoadError(f"num_experts_per_tok {top_k} must be in 1..{experts} (the experts a layer)")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(hf["moe_intermediate_size"] if family == "qwen3_moe"
                                         else hf["intermediate_size"]),
            "norm_topk_prob": family == "mixtral" or bool(hf.get("norm_topk_prob", False))}


def _dense_family_config(family: str, hf: dict[str, Any], dtype: str) -> ModelConfig:
    """Phi-3/4, Apertus and Gemma 3: Llama's layout, each family's differences as fields (transformers' defaults
    of each config class where config.json leaves a field out)."""
    heads = int(hf["num_attention_heads"])
    d = int(hf["hidden_size"])
    n = int(hf["num_hidden_layers"])
    gemma = family == "gemma3"
    common = dict(family=family, vocab_size=int(hf["vocab_size"]), hidden_size=d, num_layers=n, num_heads=heads,
                  num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                  head_dim=int(hf.get("head_dim") or (256 if gemma else d // heads)),
                  intermediate_size=int(hf["intermediate_size"]),
                  max_position_embeddings=int(hf.get("max_position_embeddings", 131072 if gemma else 4096)),
                  norm_eps=float(hf.get("rms_norm_eps", 1e-6 if gemma else 1e-5)),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)), bos_token_id=hf.get("bos_token_id"),
                  eos_token_ids=_eos_ids(hf.get("eos_token_id")), dtype=dtype)
    max_pos = common["max_position_embeddings"]
    if family == "phi3":
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hf.get('hidden_act')!r} for Phi-3 (silu)")
        rope = _rope_fields(hf, phi3=True)
        rotary = int(common["head_dim"] * rope.get("rope_partial", 1.0))
        if rotary <= 0 or rotary % 2:
            raise ModelLoadError(f"partial_rotary_factor {rope.get('rope_partial')} leaves {rotary} rotated dims "
                                 f"of {common['head_dim']}: want a positive even number")
        if "rope_longrope" in rope and any(len(f) != rotary // 2 for f in rope["rope_longrope"][:2]):
            raise ModelLoadError(f"LongRoPE short_factor and long_factor must have {rotary // 2} entries each")
        # transformers' Phi-3 applies `sliding_window` on every layer
        window = _window_size(hf.get("sliding_window"), max_pos)
        return ModelConfig(**common, layer_windows=(window,) * n if window else (), **rope)
    if family == "apertus":
        if hf.get("hidden_act", "xielu") != "xielu":
            raise ModelLoadError(f"unsupported hidden_act {hf.get('hidden_act')!r} for Apertus (xielu)")
        if hf.get("mlp_bias") or hf.get("post_norm") or hf.get("qk_norm") is False:
            raise ModelLoadError("Apertus with mlp_bias, post_norm or without qk_norm is not supported (transformers' "
                                 "Apertus has no such variants)")
        bias = bool(hf.get("attention_bias", False))
        return ModelConfig(**common, mlp_kind="xielu", activation="xielu", qk_norm=True, qkv_bias=bias, o_bias=bias,
                           **_rope_fields({"rope_theta": 12000000.0, **hf}))
    # Gemma 3 (text)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ModelLoadError(f"unsupported hidden_activation {act!r} for Gemma 3 (gelu_pytorch_tanh)")
    if hf.get("attn_logit_softcapping") is not None:
        raise ModelLoadError("Gemma 3's attn_logit_softcapping is not supported (the attention kernels do not cap)")
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3's use_bidirectional_attention is not supported (causal attention only)")
    types = hf.get("layer_types")
    if types is None:   # transformers' default: every `sliding_window_pattern`-th layer global
        pattern = int(hf.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"layer_types {types!r}: want {n} of 'sliding_attention' / 'full_attention'")
    window = _window_size(hf.get("sliding_window") or 4096, max_pos)
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:   # transformers 5: a dict per layer type
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:   # older configs: rope_theta, rope_scaling (global layers), rope_local_base_freq
        full, local = {**(hf.get("rope_scaling") or {}), **params}, {}
    full.setdefault("rope_theta", hf.get("rope_theta", 1000000.0))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ModelLoadError(f"Gemma 3 sliding-window layers' rope type {local.get('rope_type')!r} is not "
                             "supported (default only)")
    bias = bool(hf.get("attention_bias", False))
    cap = hf.get("final_logit_softcapping")
    return ModelConfig(**common, mlp_kind="geglu", activation="gelu_tanh", qk_norm=True, qkv_bias=bias, o_bias=bias,
                       layer_windows=windows if any(windows) else (),
                       rope_local_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))),
                       rope_local_layers=tuple(t == "sliding_attention" for t in types),
                       query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5, embed_scale=d ** 0.5,
                       sandwich_norms=True, final_logit_softcap=float(cap or 0.0),
                       **_rope_fields({"rope_parameters": full}))


def checkpoint_dtype(hf: dict[str, Any]) -> str:
    """The dtype a Hugging Face config.json says its weights are in ("dtype", or the older "torch_dtype");
    float32 where it says none, bfloat16 for a float8 or other low-precision checkpoint."""
    name = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else "bfloat16"


def config_from_hf(hf: dict[str, Any], dtype: str = "auto") -> ModelConfig:
    """Build a ModelConfig from the dict of a Hugging Face config.json; dtype "auto": the checkpoint's."""
    if dtype == "auto":
        dtype = checkpoint_dtype(hf)
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    family = ARCHITECTURES.get(arch)
    if family is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelLoadError(f"unknown architecture {arch!r} (supported: {supported})")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ModelLoadError(f"unsupported dtype {dtype!r} (auto, float32, bfloat16, float16)")
    try:
        if family == "gpt2":
            d = int(hf["n_embd"])
            heads = int(hf["n_head"])
            act = hf.get("activation_function", "gelu_new")
            return ModelConfig(
                family=family,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=d,
                num_layers=int(hf["n_layer"]),
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=d // heads,
                intermediate_size=int(hf.get("n_inner") or 4 * d),
                max_position_embeddings=int(hf.get("n_positions", hf.get("n_ctx", 1024))),
                norm_kind="layer",
                norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                position_kind="learned",
                mlp_kind="gelu",
                activation={"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}[act],
                qkv_bias=True,
                o_bias=True,
                mlp_bias=True,
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=_eos_ids(hf.get("eos_token_id")),
                dtype=dtype,
            )
        if family in ("phi3", "apertus", "gemma3"):
            return _dense_family_config(family, hf, dtype)
        heads = int(hf["num_attention_heads"])
        d = int(hf["hidden_size"])
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hf.get('hidden_act')!r}")
        return ModelConfig(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=d,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or d // heads),
            intermediate_size=int(hf["intermediate_size"]),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            norm_kind="rms",
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=family == "llama" and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            layer_windows=_layer_windows(hf, arch),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf.get("eos_token_id")),
            dtype=dtype,
            **_rope_fields(hf),
            **_moe_fields(family, hf),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks the field {e.args[0]!r} for {arch}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"config.json has a bad value: {e}") from None


def load_config(model_dir: str | Path, dtype: str = "auto") -> ModelConfig:
    """Read config.json (and generation_config.json's eos ids, if present) from a model folder."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist")
    cfg = config_from_hf(read_json(model_dir / "config.json"), dtype)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = read_json(gen_path)
        eos = tuple(dict.fromkeys(cfg.eos_token_ids + _eos_ids(gen.get("eos_token_id"))))
        cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    return cfg
