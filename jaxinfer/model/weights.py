"""safetensors -> parameter pytree, through a declarative map per family.

Our tree (per-layer tensors stacked on a leading layer axis, so the forward pass scans over layers):
    embed [V, D]; pos_embed [P, D] (learned positions); lm_head [V, D] (untied only);
    final_norm {scale, bias?} [D];
    layers: attn_norm {scale, bias?} [L, D]; wqkv [L, Q+2K, D]; bqkv [L, Q+2K];
            q_norm, k_norm [L, hd]; wo [L, D, Q]; bo [L, D]; mlp_norm {scale, bias?} [L, D];
            w_gate_up [L, 2I, D] (SwiGLU, gate rows first) or w_up [L, I, D], b_up [L, I] (GELU);
            w_down [L, D, I]; b_down [L, D].
    mixture of experts, in place of the MLP's matrices: router [L, E, D]; moe_gate_up [L, E, 2I, D] (each
            expert's gate rows first); moe_down [L, E, D, I].
Linear weights keep the Hugging Face [out, in] layout: decode kernels read one output row per lane
group. Q/K/V and gate/up are concatenated at load time so each is one projection.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from jaxinfer.model import quantize, rotary
from jaxinfer.model.config import ModelConfig
from jaxinfer.errors import ModelLoadError

Shape = tuple[int, ...]
LOAD_THREADS = 8   # tensors assembled and sent to the device side by side


@dataclasses.dataclass(frozen=True)
class Rule:
    """One tensor of our tree, made by concatenating (on axis 0) one or more HF tensors."""

    dest: str                                     # dotted path in our tree
    sources: tuple[str, ...]                      # HF names; "{i}" marks a per-layer tensor
    shapes: Callable[[ModelConfig], list[Shape]]  # expected shape of each source, in our layout
    transpose: bool = False                       # GPT-2 Conv1D stores [in, out]
    when: Callable[[ModelConfig], bool] = lambda c: True
    # (cfg, source index, array) -> the array as our tree holds it: a row order, a folded constant
    convert: Callable[[ModelConfig, int, np.ndarray], np.ndarray] | None = None
    shard: str | None = None                      # tensor parallel split (model.tensor_parallel): None, "out", "in",
                                                  # "gate_up" (a fused gate|up's halves), "qkv" (rows by head),
                                                  # "heads" (columns by q head)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.sources[0]

    @property
    def per_expert(self) -> bool:
        """"{e}" marks a per-expert tensor: stacked on an expert axis after the layer axis."""
        return "{e}" in self.sources[0]


def _norm_rules(dest: str, hf: str, has_bias: bool) -> list[Rule]:
    rules = [Rule(f"{dest}.scale", (f"{hf}.weight",), lambda c: [(c.hidden_size,)])]
    if has_bias:
        rules.append(Rule(f"{dest}.bias", (f"{hf}.bias",), lambda c: [(c.hidden_size,)]))
    return rules


def _qkv_shapes(c: ModelConfig) -> list[Shape]:
    return [(c.q_size, c.hidden_size), (c.kv_size, c.hidden_size), (c.kv_size, c.hidden_size)]


_ATT = "model.layers.{i}.self_attn"
_MLP = "model.layers.{i}.mlp"
LLAMA_RULES: list[Rule] = [
    Rule("embed", ("model.embed_tokens.weight",), lambda c: [(c.vocab_size, c.hidden_size)], shard="out"),
    Rule("lm_head", ("lm_head.weight",), lambda c: [(c.vocab_size, c.hidden_size)],
         when=lambda c: not c.tie_embeddings, shard="out"),
    *_norm_rules("final_norm", "model.norm", False),
    *_norm_rules("layers.attn_norm", "model.layers.{i}.input_layernorm", False),
    *_norm_rules("layers.mlp_norm", "model.layers.{i}.post_attention_layernorm", False),
    Rule("layers.wqkv", (f"{_ATT}.q_proj.weight", f"{_ATT}.k_proj.weight", f"{_ATT}.v_proj.weight"), _qkv_shapes,
         shard="qkv"),
    Rule("layers.bqkv", (f"{_ATT}.q_proj.bias", f"{_ATT}.k_proj.bias", f"{_ATT}.v_proj.bias"),
         lambda c: [(c.q_size,), (c.kv_size,), (c.kv_size,)], when=lambda c: c.qkv_bias, shard="qkv"),
    Rule("layers.q_norm", (f"{_ATT}.q_norm.weight",), lambda c: [(c.head_dim,)], when=lambda c: c.qk_norm),
    Rule("layers.k_norm", (f"{_ATT}.k_norm.weight",), lambda c: [(c.head_dim,)], when=lambda c: c.qk_norm),
    Rule("layers.wo", (f"{_ATT}.o_proj.weight",), lambda c: [(c.hidden_size, c.q_size)], shard="heads"),
    Rule("layers.bo", (f"{_ATT}.o_proj.bias",), lambda c: [(c.hidden_size,)], when=lambda c: c.o_bias),
    Rule("layers.w_gate_up", (f"{_MLP}.gate_proj.weight", f"{_MLP}.up_proj.weight"),
         lambda c: [(c.intermediate_size, c.hidden_size)] * 2, shard="out"),
    Rule("layers.w_down", (f"{_MLP}.down_proj.weight",), lambda c: [(c.hidden_size, c.intermediate_size)],
         shard="in"),
]

_H = "h.{i}"
GPT2_RULES: list[Rule] = [
    Rule("embed", ("wte.weight",), lambda c: [(c.vocab_size, c.hidden_size)], shard="out"),
    Rule("pos_embed", ("wpe.weight",), lambda c: [(c.max_position_embeddings, c.hidden_size)]),
    Rule("lm_head", ("lm_head.weight",), lambda c: [(c.vocab_size, c.hidden_size)],
         when=lambda c: not c.tie_embeddings, shard="out"),
    *_norm_rules("final_norm", "ln_f", True),
    *_norm_rules("layers.attn_norm", f"{_H}.ln_1", True),
    *_norm_rules("layers.mlp_norm", f"{_H}.ln_2", True),
    Rule("layers.wqkv", (f"{_H}.attn.c_attn.weight",), lambda c: [(3 * c.hidden_size, c.hidden_size)], transpose=True,
         shard="qkv"),
    Rule("layers.bqkv", (f"{_H}.attn.c_attn.bias",), lambda c: [(3 * c.hidden_size,)], shard="qkv"),
    Rule("layers.wo", (f"{_H}.attn.c_proj.weight",), lambda c: [(c.hidden_size, c.hidden_size)], transpose=True,
         shard="heads"),
    Rule("layers.bo", (f"{_H}.attn.c_proj.bias",), lambda c: [(c.hidden_size,)]),
    Rule("layers.w_up", (f"{_H}.mlp.c_fc.weight",), lambda c: [(c.intermediate_size, c.hidden_size)], transpose=True,
         shard="out"),
    Rule("layers.b_up", (f"{_H}.mlp.c_fc.bias",), lambda c: [(c.intermediate_size,)], shard="out"),
    Rule("layers.w_down", (f"{_H}.mlp.c_proj.weight",), lambda c: [(c.hidden_size, c.intermediate_size)], transpose=True,
         shard="in"),
    Rule("layers.b_down", (f"{_H}.mlp.c_proj.bias",), lambda c: [(c.hidden_size,)]),
]


def _moe_rules(block: str, gate: str, up: str, down: str) -> list[Rule]:
    """Llama's attention and norms, and a mixture of experts in place of its MLP (the router, the experts'
    matrices stacked per layer); block: the MLP module's HF name, gate/up/down: its experts' matrices'. Tensor
    parallel: every expert's intermediate rows split as a dense MLP's (gate|up "out", down "in"), the router
    replicated."""
    experts = f"{block}.experts.{{e}}"
    return [r for r in LLAMA_RULES if r.dest not in ("layers.w_gate_up", "layers.w_down")] + [
        Rule("layers.router", (f"{block}.gate.weight",), lambda c: [(c.num_experts, c.hidden_size)]),
        Rule("layers.moe_gate_up", (f"{experts}.{gate}.weight", f"{experts}.{up}.weight"),
             lambda c: [(c.moe_intermediate_size, c.hidden_size)] * 2, shard="out"),
        Rule("layers.moe_down", (f"{experts}.{down}.weight",), lambda c: [(c.hidden_size, c.moe_intermediate_size)],
             shard="in"),
    ]


RULES: dict[str, list[Rule]] = {"llama": LLAMA_RULES, "qwen2": LLAMA_RULES, "qwen3": LLAMA_RULES, "gpt2": GPT2_RULES,
                                "qwen3_moe": _moe_rules(_MLP, "gate_proj", "up_proj", "down_proj"),
                                "mixtral": _moe_rules("model.layers.{i}.block_sparse_moe", "w1", "w3", "w2")}
# Prefixes a checkpoint may put before the names above (GPT-2 saved by transformers uses "transformer.").
PREFIXES: dict[str, tuple[str, ...]] = {"gpt2": ("", "transformer."), "llama": ("",), "qwen2": ("",), "qwen3": ("",),
                                        "qwen3_moe": ("",), "mixtral": ("",)}


def _derived(base: list[Rule], changes: dict[str, dict[str, Any] | None], extra: tuple[Rule, ...] = ()) -> list[Rule]:
    """The rules of `base` with some fields replaced (by dest; None drops the rule), then `extra`."""
    return [dataclasses.replace(r, **changes.get(r.dest, {})) for r in base if changes.get(r.dest, {}) is not None] \
        + list(extra)


def _fused_qkv_rows(c: ModelConfig, k: int, a: np.ndarray) -> np.ndarray:
    """A fused q/k/v projection's q and k rows in model/rotary.py's order (a partial rotary factor)."""
    order = rotary.qk_rows(c, a.shape[0], q_rows=True, fused=True)
    return a if order is None else a[order]


def _one_plus(c: ModelConfig, k: int, a: np.ndarray) -> np.ndarray:
    """Gemma's RMSNorm weight w scales by 1 + w (in float32, as transformers adds it)."""
    return a.astype(np.float32) + np.float32(1)


def _gemma_q_norm(c: ModelConfig, k: int, a: np.ndarray) -> np.ndarray:
    """1 + w, times query_pre_attn_scalar ** -0.5 / head_dim ** -0.5: the attention ops keep head_dim ** -0.5."""
    ratio = c.query_scale / c.head_dim ** -0.5 if c.query_scale else 1.0
    return _one_plus(c, k, a) * np.float32(ratio)


_LAYER = "model.layers.{i}"
_UP = Rule("layers.w_up", (f"{_MLP}.up_proj.weight",), lambda c: [(c.intermediate_size, c.hidden_size)])
PHI3_RULES = _derived(LLAMA_RULES, {
    "layers.wqkv": dict(sources=(f"{_ATT}.qkv_proj.weight",), convert=_fused_qkv_rows,
                        shapes=lambda c: [(c.q_size + 2 * c.kv_size, c.hidden_size)]),
    "layers.w_gate_up": dict(sources=(f"{_MLP}.gate_up_proj.weight",),
                             shapes=lambda c: [(2 * c.intermediate_size, c.hidden_size)], shard="gate_up"),
    "layers.bqkv": None, "layers.q_norm": None, "layers.k_norm": None, "layers.bo": None})
APERTUS_RULES = _derived(LLAMA_RULES, {
    "layers.attn_norm.scale": dict(sources=(f"{_LAYER}.attention_layernorm.weight",)),
    "layers.mlp_norm.scale": dict(sources=(f"{_LAYER}.feedforward_layernorm.weight",)),
    "layers.w_gate_up": dict(dest="layers.w_up", sources=_UP.sources, shapes=_UP.shapes),
}, (Rule("layers.xielu", tuple(f"{_MLP}.act_fn.{p}" for p in ("alpha_p", "alpha_n", "beta", "eps")),
         lambda c: [(1,)] * 4, convert=lambda c, k, a: np.reshape(a, (1,))),))   # beta and eps are scalars
_GEMMA_NORMS = {"final_norm.scale": "model.norm", "layers.attn_norm.scale": f"{_LAYER}.input_layernorm",
                "layers.mlp_norm.scale": f"{_LAYER}.pre_feedforward_layernorm"}
GEMMA3_RULES = _derived(LLAMA_RULES, {
    **{dest: dict(sources=(f"{hf}.weight",), convert=_one_plus) for dest, hf in _GEMMA_NORMS.items()},
    "layers.q_norm": dict(convert=_gemma_q_norm), "layers.k_norm": dict(convert=_one_plus),
}, tuple(Rule(f"layers.{dest}.scale", (f"{_LAYER}.{hf}.weight",), lambda c: [(c.hidden_size,)], convert=_one_plus)
         for dest, hf in (("attn_out_norm", "post_attention_layernorm"),
                          ("mlp_out_norm", "post_feedforward_layernorm"))))
RULES.update(phi3=PHI3_RULES, apertus=APERTUS_RULES, gemma3=GEMMA3_RULES)
PREFIXES.update(phi3=("",), apertus=("",), gemma3=("",))


# safetensors dtype names -> numpy dtypes (numpy has no bfloat16 or float8: ml_dtypes provides them)
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class CheckpointReader:
    """Name -> numpy array over one or several safetensors files of a model folder.

    Arrays are read-only views of the memory-mapped files (safetensors' own reader copies each
    tensor out first): assembling the parameters then copies each byte once, from the page cache."""

    def __init__(self, model_dir: Path):
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from None
            files = sorted(set(weight_map.values()))
        elif (model_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ModelLoadError(f"{model_dir} holds no model.safetensors (nor model.safetensors.index.json)")
        self._maps: dict[str, np.memmap] = {}
        self._entries: dict[str, tuple[str, Any, Shape, int, int]] = {}   # name -> (file, dtype, shape, start, end)
        for name in files:
            path = model_dir / name
            if not path.is_file():
                raise ModelLoadError(f"{path} is listed in the index but missing")
            try:
                header_len, header = self._check_size(path)
                with safe_open(str(path), framework="np") as handle:   # its checks of the header
                    keys = list(handle.keys())
                base = 8 + header_len
                for k in keys:
                    v = header[k]
                    self._entries[k] = (name, _DTYPES.get(v["dtype"]), tuple(v["shape"]), base + v["data_offsets"][0],
                                        base + v["data_offsets"][1])
            except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
                if isinstance(e, ModelLoadError):
                    raise
                raise ModelLoadError(f"{path} is not a readable safetensors file ({e})") from None
            self._maps[name] = np.memmap(path, dtype=np.uint8, mode="r")

    @staticmethod
    def _check_size(path: Path) -> tuple[int, dict]:
        # Name truncation plainly (safetensors reports it as "incomplete metadata").
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len > path.stat().st_size:
                raise ValueError(f"header length {header_len} exceeds the file")
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if path.stat().st_size < 8 + header_len + end:
            raise ModelLoadError(f"{path} is truncated: {path.stat().st_size} bytes, header needs {8 + header_len + end}")
        return header_len, header

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> np.ndarray:
        file, dtype, shape, start, end = self._entries[name]   # offsets checked against shape by safe_open
        if dtype is None:
            raise ModelLoadError(f"{file}: tensor {name!r} has a dtype this reader does not know")
        return self._maps[file][start:end].view(dtype).reshape(shape)


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def load_params(model_dir: str | Path, cfg: ModelConfig, progress: bool = True, per_layer: bool = False,
                quantization: str | None = None, mesh: Any = None) -> dict:
    """Read a Hugging Face folder's weights into our tree, checked against `cfg`, on the default device (or
    with `mesh`, a jax.sharding.Mesh of more than one device, split over it as each Rule's `shard` says:
    model.tensor_parallel; each device's slices read alone).

    per_layer: the layer matrices as one array per layer (transformer.split_layers' layout, which unrolled
    layers read), sent to the device straight from the mapped files and joined there: no stacked copy on the
    host, none to slice on the device.
    quantization: "int8" or "fp8": the linear matrices quantized at load, a layer at a time (model.quantize); a
    pre-quantized checkpoint's are read with their scales whatever it is (it must name their format if set)."""
    model_dir = Path(model_dir)
    quant = quantize.plan(model_dir, quantization)
    if mesh is not None and mesh.size > 1:
        from jaxinfer.model import tensor_parallel   # it reads RULES from here

        tensor_parallel.check(cfg, mesh.size)
    else:
        mesh = None
    reader = CheckpointReader(model_dir)
    prefixes = PREFIXES[cfg.family]
    np_dtype = np.dtype(cfg.jnp_dtype)

    def resolve(name: str) -> str:
        for p in prefixes:
            if p + name in reader:
                return p + name
        raise ModelLoadError(f"{model_dir}: tensor {name!r} is missing from the checkpoint")

    def read(name: str, shape: Shape, transpose: bool) -> np.ndarray:
        full = resolve(name)
        arr = reader.get(full)
        if transpose and arr.ndim == 2:
            arr = arr.T
        if name in converts:
            arr = converts[name](arr)
        if tuple(arr.shape) != tuple(shape):
            want = shape[::-1] if transpose else shape
            got = arr.shape[::-1] if transpose else arr.shape
            raise ModelLoadError(f"{model_dir}: tensor {full!r} has shape {tuple(got)}, expected {tuple(want)}")
        return arr

    def find(name: str) -> np.ndarray | None:
        return next((reader.get(p + name) for p in prefixes if p + name in reader), None)

    rules = [r for r in RULES[cfg.family] if r.when(cfg)]
    # Rule.convert by the checkpoint name of each source it applies to (read applies it)
    converts = {src.format(i=i): functools.partial(r.convert, cfg, k) for r in rules if r.convert is not None
                for k, src in enumerate(r.sources) for i in range(cfg.num_layers)}
    if quant.checkpoint and cfg.rotary_dim != cfg.head_dim:
        raise quantize.QuantizationError(f"{model_dir}: a pre-quantized checkpoint with a partial rotary factor is not "
                                         "supported (its q/k rows are reordered at load, their scales are not)")
    if quant.checkpoint:   # scales only beside the linear matrices' tensors (a quantized embedding: an error)
        quantize.check_scaled(reader.keys(), [p + src.format(i=i, e=e) for r in rules
                                              if r.dest in quantize.LINEAR_DESTS | quantize.EXPERT_DESTS
                                              for src in r.sources for i in range(cfg.num_layers)
                                              for e in range(cfg.num_experts if r.per_expert else 1)
                                              for p in prefixes], quant.checkpoint)
    if quant.at_load and cfg.tie_embeddings:   # the head reads a quantized copy; the lookup keeps the embedding
        rules.append(dataclasses.replace(next(r for r in rules if r.dest == "embed"), dest="lm_head"))
    tree: dict = {}

    def quantized(rule: Rule) -> bool:   # held in 8 bits: quantized now, or by the checkpoint (its scales)
        if rule.dest not in quantize.LINEAR_DESTS | quantize.EXPERT_DESTS or not (quant.at_load or quant.checkpoint):
            return False
        if quant.at_load:
            return True
        first = rule.sources[0].format(i=0, e=0)   # (the first expert's, for an expert stack)
        if rule.transpose and find(first) is not None and find(first.removesuffix("weight") +
                                                             quant.checkpoint.scale_suffix) is not None:
            raise quantize.QuantizationError(f"{model_dir}: quantized {first!r} of a transposed (Conv1D) layer")
        return find(first.removesuffix("weight") + quant.checkpoint.scale_suffix) is not None or \
            (find(first) is not None and find(first).dtype.itemsize == 1)

    def parts(rule: Rule, **names) -> list[tuple[str, np.ndarray]]:   # one matrix's sources: (name, as read)
        return [(resolve(src.format(**names)), read(src.format(**names), shape, rule.transpose))
                for src, shape in zip(rule.sources, rule.shapes(cfg))]

    def checkpoint_matrix(rule: Rule, **names):   # the checkpoint's 8-bit matrix on the host, experts stacked
        if rule.per_expert:
            return quantize.stack_experts([quantize.read_joined(parts(rule, **names, e=e), find, quant.checkpoint)
                                           for e in range(cfg.num_experts)])
        return quantize.read_joined(parts(rule, **names), find, quant.checkpoint)

    def quantized_experts(rule: Rule, i: int):   # layer i's [E, N, K] experts, quantized on the device or read
        if quant.at_load:
            experts = _fill_layer(rule, cfg, read, i, np.empty((cfg.num_experts, *_rows_shape(rule, cfg)), np_dtype))
            return quantize.quantize(jax.device_put(experts), quant.at_load)
        return jax.device_put(checkpoint_matrix(rule, i=i))

    def quantized_layer(rule: Rule, i: int | None):
        return quantize.quantized_matrix(parts(rule, i=i), quant, find)

    def sharded_quantized(rule: Rule) -> Any:   # an 8-bit rule's layers over the mesh, one at a time
        def one(r: Rule):   # a rule without layers: quantized on the mesh, or read and laid out for it
            if quant.at_load:
                return tensor_parallel.quantize_sharded(tensor_parallel.load_sharded(r, cfg, read, np_dtype, mesh),
                                                        r, quant.at_load, mesh)
            return tensor_parallel.place_quantized(checkpoint_matrix(r), r, cfg, mesh)

        return tensor_parallel.load_quantized(rule, cfg, one, per_layer)

    threads = max(1, min(LOAD_THREADS, os.cpu_count() or 1))

    # Tensors are read, assembled and sent side by side, and the layers of one stacked tensor are
    # filled side by side too (the largest, gate/up, is 3.6 GB for Qwen3-4B): numpy's copies, the
    # reads from the mapped files and the host-to-device copies release the GIL.
    with tqdm(total=len(rules), desc="loading weights", unit="tensor", disable=not progress, leave=False) as bar, \
            ThreadPoolExecutor(threads) as pool, ThreadPoolExecutor(threads) as layer_pool:
        def build(rule: Rule):
            if mesh is not None and quantized(rule):
                return rule, sharded_quantized(rule)
            if mesh is not None:
                return rule, tensor_parallel.load_sharded(rule, cfg, read, np_dtype, mesh, per_layer)
            if quantized(rule) and rule.per_expert:   # experts: a layer at a time, as below
                if per_layer:
                    return rule, [quantized_experts(rule, i) for i in range(cfg.num_layers)]
                return rule, quantize.stack_layers(lambda i: quantized_experts(rule, i), cfg.num_layers)
            if quantized(rule):   # a layer at a time: only the 8-bit stack stays on the device
                if not rule.per_layer:
                    return rule, quantized_layer(rule, None)
                if per_layer:
                    return rule, [quantized_layer(rule, i) for i in range(cfg.num_layers)]
                return rule, quantize.stack_layers(lambda i: quantized_layer(rule, i), cfg.num_layers)
            if per_layer and rule.per_expert:   # each layer's experts assembled on the host, sent as one array
                return rule, list(layer_pool.map(lambda i: jax.device_put(_fill_layer(rule, cfg, read, i, np.empty(
                    (cfg.num_experts, *_rows_shape(rule, cfg)), np_dtype))), range(cfg.num_layers)))
            if per_layer and rule.per_layer and len(rule.shapes(cfg)[0]) == 2:
                return rule, list(layer_pool.map(lambda i: _layer_matrix(rule, cfg, read, i), range(cfg.num_layers)))
            return rule, jax.device_put(_assemble(rule, cfg, read, np_dtype, layer_pool.map))

        for rule, value in pool.map(build, rules):
            _set(tree, rule.dest, value)
            bar.update(1)
    if per_layer:   # as transformer.split_layers lays them out: per-layer matrices, stacked vectors
        is_list = lambda x: isinstance(x, list)
        layers = tree["layers"]
        tree["layers"] = [jax.tree.map(lambda a, i=i: a[i] if is_list(a) else None, layers, is_leaf=is_list)
                          for i in range(cfg.num_layers)]
        tree["layer_vectors"] = jax.tree.map(lambda a: None if is_list(a) else a, layers, is_leaf=is_list)
    return tree


@functools.partial(jax.jit, static_argnames="dtype")
def _joined(parts: tuple[jax.Array, ...], dtype) -> jax.Array:
    return jnp.concatenate([p.astype(dtype) for p in parts])


def _layer_matrix(rule: Rule, cfg: ModelConfig, read: Callable[[str, Shape, bool], np.ndarray], i: int) -> jax.Array:
    """Layer i's matrix of a per-layer rule on the device: its sources sent as they lie in the mapped files,
    joined (and cast to the model's dtype) there."""
    parts = tuple(jax.device_put(np.ascontiguousarray(read(src.format(i=i), shape, rule.transpose)))
                  for src, shape in zip(rule.sources, rule.shapes(cfg)))
    if len(parts) == 1 and parts[0].dtype == cfg.jnp_dtype:
        return parts[0]
    return _joined(parts, cfg.jnp_dtype)


def _assemble(rule: Rule, cfg: ModelConfig, read: Callable[[str, Shape, bool], np.ndarray], dtype,
              map_fn: Callable = map) -> np.ndarray:
    """The rule's sources concatenated (per expert and per layer, then stacked on leading layer and expert axes),
    written once into one array of `dtype`; `map_fn` runs the layers (a thread pool's map: side by side)."""
    layers = list(range(cfg.num_layers)) if rule.per_layer else [None]
    out = np.empty((len(layers), *((cfg.num_experts,) if rule.per_expert else ()), *_rows_shape(rule, cfg)), dtype)
    for _ in map_fn(lambda j: _fill_layer(rule, cfg, read, layers[j], out[j]), range(len(layers))):
        pass
    return out if rule.per_layer else out[0]


def _rows_shape(rule: Rule, cfg: ModelConfig) -> Shape:
    """The shape of one layer's (one expert's) concatenated sources."""
    shapes = rule.shapes(cfg)
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def _fill_layer(rule: Rule, cfg: ModelConfig, read: Callable[[str, Shape, bool], np.ndarray], i: int | None,
                out: np.ndarray) -> np.ndarray:
    """Write layer i's sources, concatenated, into out ([E, rows, ...] for a per-expert rule, expert by expert)."""
    for e, dest in (enumerate(out) if rule.per_expert else [(None, out)]):
        r = 0
        for src, shp in zip(rule.sources, rule.shapes(cfg)):
            dest[r:r + shp[0]] = read(src.format(i=i, e=e), shp, rule.transpose)
            r += shp[0]
    return out
