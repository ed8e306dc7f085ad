"""8-bit weights at load: quantizing a float checkpoint's matrices, or reading a pre-quantized checkpoint's.

What is held in 8 bits (ops.quantized.QuantizedWeight): every linear layer's matrix (wqkv, wo, w_gate_up / w_up,
w_down) and the lm_head; embeddings, norms and biases stay in the model's dtype. With tied embeddings, quantizing
at load adds a quantized copy of the embedding as the lm_head (the lookup keeps the float one): half the
embedding's bytes more memory, half fewer read by every decode step (Qwen3-4B: 0.39 GB a step of ~4.4).

Pre-quantized checkpoints, read as published (config.json `quantization_config`):
- `quant_method: "fp8"` (the official Qwen3 FP8 releases): `*.weight` float8_e4m3fn and `*.weight_scale_inv`
  float32 [ceil(out / bo), ceil(in / bi)], `weight_block_size: [bo, bi]`; the matrix is weight * scale per block.
- `quant_method: "compressed-tensors"` (llm-compressor), formats int-quantized / float-quantized /
  naive-quantized, 8-bit symmetric weights of strategy channel (`*.weight_scale` [out, 1]), tensor ([1]) or
  block (`block_structure`); input activation schemes (W8A8) are accepted and the weights used alone.
A tensor is quantized where its scale tensor is present (the config's `ignore` list, e.g. lm_head, leaves it in
the model's dtype). `--quantization` on a pre-quantized checkpoint must name its own format (then it is used as
published); another is an error, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.errors import ModelLoadError
from jaxinfer.ops.quantized import FORMATS, QuantizedWeight, join, quantize

# Our tree's matrices held in 8 bits (the destinations of model.weights' rules).
LINEAR_DESTS = frozenset({"layers.wqkv", "layers.wo", "layers.w_gate_up", "layers.w_up", "layers.w_down", "lm_head"})
# A mixture of experts' expert stacks [L, E, N, K], quantized at load with one scale an expert's output row (the
# router's small matrix stays in the model's dtype: routing decides which weights are read at all)
EXPERT_DESTS = frozenset({"layers.moe_gate_up", "layers.moe_down"})
CT_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")   # compressed-tensors' 8-bit ones
_NP_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}


class QuantizationError(ModelLoadError):
    """A quantized checkpoint this loader cannot read, or a quantization setting that does not fit it."""


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """A pre-quantized checkpoint's format, from its config.json."""

    method: str                          # "fp8" or "compressed-tensors"
    formats: frozenset[str]              # the weights' formats: {"fp8"}, {"int8"}, ...
    scale_suffix: str                    # a weight's scale tensor: name minus "weight" plus this
    block: tuple[int, int] | None        # block scales' (bo, bi); None: per channel (or per tensor)


@dataclasses.dataclass(frozen=True)
class QuantizationPlan:
    at_load: str | None                          # "int8" / "fp8": quantize the float matrices while loading
    checkpoint: CheckpointQuantization | None    # the checkpoint's own quantization, read as published


def plan(model_dir: str | Path, setting: str | None) -> QuantizationPlan:
    """What loading does with the matrices, given the checkpoint and the `quantization` setting."""
    if setting is not None and setting not in FORMATS:
        raise QuantizationError(f"quantization {setting!r} is not one of {', '.join(FORMATS)}")
    ckpt = checkpoint_quantization(model_dir)
    if ckpt is None:
        return QuantizationPlan(setting, None)
    if setting is not None and ckpt.formats != {setting}:
        raise QuantizationError(
            f"{model_dir} is already quantized ({ckpt.method}, {'/'.join(sorted(ckpt.formats))} weights): "
            f"quantization={setting!r} does not match it; leave quantization unset to use it as published")
    return QuantizationPlan(None, ckpt)


def checkpoint_quantization(model_dir: str | Path) -> CheckpointQuantization | None:
    """The checkpoint's quantization_config, checked; None for a float checkpoint."""
    path = Path(model_dir) / "config.json"
    try:
        qc = json.loads(path.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None   # load_config reports an unreadable config.json
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizationError(f"{path}: quantization_config is not an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_block_format(path, qc)
    if method == "compressed-tensors":
        return _compressed_tensors_format(path, qc)
    raise QuantizationError(f"{path}: quant_method {method!r} is not supported (fp8 with weight_block_size, or "
                            f"compressed-tensors with 8-bit weights)")


def _block_size(path: Path, value, key: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise QuantizationError(f"{path}: {key} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _fp8_block_format(path: Path, qc: dict) -> CheckpointQuantization:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise QuantizationError(f"{path}: fp8 fmt {qc.get('fmt')!r} is not supported (e4m3)")
    if "weight_block_size" not in qc or qc["weight_block_size"] is None:
        raise QuantizationError(f"{path}: fp8 quantization without weight_block_size (per-tensor scales) is not "
                                f"supported")
    return CheckpointQuantization("fp8", frozenset({"fp8"}), "weight_scale_inv",
                                  _block_size(path, qc["weight_block_size"], "weight_block_size"))


def _compressed_tensors_format(path: Path, qc: dict) -> CheckpointQuantization:
    fmt = qc.get("format")
    if fmt not in CT_FORMATS:
        raise QuantizationError(f"{path}: compressed-tensors format {fmt!r} is not supported ({', '.join(CT_FORMATS)})")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError(f"{path}: compressed-tensors quantization_config has no config_groups")
    formats, blocks = set(), set()
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict):
            raise QuantizationError(f"{path}: config group {name!r} quantizes no weights")
        where = f"{path}: config group {name!r}"
        if w.get("num_bits") != 8 or w.get("type") not in ("int", "float"):
            raise QuantizationError(f"{where}: {w.get('num_bits')}-bit {w.get('type')} weights are not supported "
                                    f"(8-bit int or float)")
        if not w.get("symmetric", True):
            raise QuantizationError(f"{where}: asymmetric weights (zero points) are not supported")
        if w.get("dynamic"):
            raise QuantizationError(f"{where}: dynamically quantized weights are not supported")
        strategy = w.get("strategy")
        if strategy == "block":
            blocks.add(_block_size(path, w.get("block_structure"), f"group {name!r} block_structure"))
        elif strategy not in ("channel", "tensor"):
            raise QuantizationError(f"{where}: weight strategy {strategy!r} is not supported (channel, tensor, block)")
        formats.add("int8" if w["type"] == "int" else "fp8")
    if len(blocks) > 1 or (blocks and len(groups) > 1):
        raise QuantizationError(f"{path}: config groups with different scale layouts are not supported")
    return CheckpointQuantization("compressed-tensors", frozenset(formats), "weight_scale",
                                  blocks.pop() if blocks else None)


def read_quantized(name: str, values: np.ndarray, find: Callable[[str], np.ndarray | None],
                   ckpt: CheckpointQuantization) -> QuantizedWeight | None:
    """The checkpoint's tensor `name` ([out, in], as read) with its scales, as a QuantizedWeight of numpy arrays;
    None where the checkpoint keeps it unquantized (no scale, a float dtype). `find`: a tensor by name or None."""
    base = name.removesuffix("weight")
    scale = find(base + ckpt.scale_suffix)
    quantized_dtype = values.dtype in _NP_DTYPES.values()
    if scale is None:
        if quantized_dtype:
            raise QuantizationError(f"tensor {name!r} is {values.dtype.name} but its scales "
                                    f"{base + ckpt.scale_suffix!r} are missing")
        return None
    if not quantized_dtype:
        raise QuantizationError(f"tensor {name!r} has scales but is {values.dtype.name}, not int8 or float8_e4m3fn")
    zero = find(base + "weight_zero_point")
    if zero is not None and np.any(zero != 0):
        raise QuantizationError(f"tensor {name!r} has nonzero zero points: asymmetric weights are not supported")
    out, inp = values.shape
    scale = np.asarray(scale, np.float32)
    if ckpt.block is not None:
        bo, bi = ckpt.block
        want = (-(-out // bo), -(-inp // bi))
        if scale.shape != want:
            raise QuantizationError(
                f"tensor {name!r} [{out}, {inp}] with block size [{bo}, {bi}] needs scales of shape {list(want)}, "
                f"got {list(scale.shape)} from {base + ckpt.scale_suffix!r}")
        return QuantizedWeight(values, scale, ckpt.block)
    if scale.size == 1:     # per tensor
        scale = np.full((out,), scale.reshape(()), np.float32)
    elif scale.shape in ((out, 1), (out,)):
        scale = scale.reshape(out)
    else:
        raise QuantizationError(f"tensor {name!r} [{out}, {inp}]: scales of shape {list(scale.shape)} are neither "
                                f"per channel [{out}, 1] nor per tensor")
    return QuantizedWeight(values, scale)


def check_scaled(names: list[str], linear: list[str], ckpt: CheckpointQuantization) -> None:
    """Every scale tensor of the checkpoint (among `names`) belongs to one of the `linear` matrices' tensors: an
    embedding or norm stored quantized would otherwise be read without its scales."""
    linear = set(linear)
    for name in names:
        if name.endswith("." + ckpt.scale_suffix) and name.removesuffix(ckpt.scale_suffix) + "weight" not in linear:
            raise QuantizationError(f"{name!r}: only linear layers' matrices are read quantized, not "
                                    f"{name.removesuffix(ckpt.scale_suffix) + 'weight'!r}")


@functools.partial(jax.jit, static_argnames="fmt")
def _quantize_joined(parts: tuple[jax.Array, ...], fmt: str) -> QuantizedWeight:
    return quantize(jnp.concatenate(parts), fmt)


def read_joined(parts: list[tuple[str, np.ndarray]], find: Callable[[str], np.ndarray | None],
                ckpt: CheckpointQuantization) -> QuantizedWeight:
    """A pre-quantized checkpoint's tensors (name, [out, in] as read) with their scales, joined along out, as a
    QuantizedWeight of numpy arrays."""
    read = [read_quantized(name, a, find, ckpt) for name, a in parts]
    if any(q is None for q in read):
        raise QuantizationError(f"tensors {[n for n, _ in parts]} are joined into one matrix but only some are "
                                f"quantized in the checkpoint")
    try:
        return join(read)
    except ValueError as e:
        raise QuantizationError(f"tensors {[n for n, _ in parts]}: {e}") from None


def stack_experts(experts: list[QuantizedWeight]) -> QuantizedWeight:
    """One layer's experts' matrices (numpy QuantizedWeights of one layout) as one [E, out, in] QuantizedWeight."""
    if any(q.block != experts[0].block or q.scale.shape != experts[0].scale.shape for q in experts):
        raise QuantizationError("a layer's experts are quantized unlike one another (their scales' layouts differ)")
    return QuantizedWeight(np.stack([np.asarray(q.values) for q in experts]),
                           np.stack([np.asarray(q.scale, np.float32) for q in experts]), experts[0].block)


def quantized_matrix(parts: list[tuple[str, np.ndarray]], plan_: QuantizationPlan,
                     find: Callable[[str], np.ndarray | None]) -> QuantizedWeight:
    """One layer's matrix on the default device from its checkpoint tensors (name, [out, in] as read), joined
    along out: quantized there from the float tensors (plan_.at_load), or read with their scales."""
    if plan_.at_load is not None:
        if sum(a.size for _, a in parts) > CHUNK_ELEMENTS:   # an lm_head: rows a chunk at a time
            return _quantized_in_chunks([a for _, a in parts], plan_.at_load)
        return _quantize_joined(tuple(jax.device_put(np.ascontiguousarray(a)) for _, a in parts), plan_.at_load)
    joined = read_joined(parts, find, plan_.checkpoint)
    return jax.device_put(QuantizedWeight(np.ascontiguousarray(joined.values), np.ascontiguousarray(joined.scale),
                                          joined.block))


# A matrix of more elements is quantized a chunk of rows at a time (each row's scale is its own): its float copy on
# the device is then one chunk, not the whole (Llama-3-8B's lm_head is 1.05 GB in bf16, 2.1 GB in float32).
CHUNK_ELEMENTS = 1 << 24


def _quantized_in_chunks(parts: list[np.ndarray], fmt: str) -> QuantizedWeight:
    rows, width = sum(a.shape[0] for a in parts), parts[0].shape[1]
    out = QuantizedWeight(jnp.zeros((rows, width), FORMATS[fmt]), jnp.zeros((rows,), jnp.float32))
    step = max(1, CHUNK_ELEMENTS // width)
    start = 0
    for a in parts:
        for r in range(0, a.shape[0], step):
            piece = quantize(jax.device_put(np.ascontiguousarray(a[r:r + step])), fmt)
            out = _put_rows(out, piece, jnp.int32(start + r))
        start += a.shape[0]
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(out: QuantizedWeight, piece: QuantizedWeight, start: jax.Array) -> QuantizedWeight:
    return QuantizedWeight(jax.lax.dynamic_update_slice_in_dim(out.values, piece.values, start, 0),
                           jax.lax.dynamic_update_slice_in_dim(out.scale, piece.scale, start, 0))


@functools.partial(jax.jit, donate_argnums=0)
def _put_layer(stacked: QuantizedWeight, layer: QuantizedWeight, i: jax.Array) -> QuantizedWeight:
    return QuantizedWeight(stacked.values.at[i].set(layer.values), stacked.scale.at[i].set(layer.scale),
                           stacked.block)


def _stack_of(a: jax.Array, n: int) -> jax.Array:
    """Zeros for n arrays like `a` stacked on a new leading axis, split over a's mesh as a is (tensor parallelism)."""
    sharding = a.sharding
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
        stacked = NamedSharding(sharding.mesh, P(None, *sharding.spec))
        return jax.jit(lambda: jnp.zeros((n, *a.shape), a.dtype), out_shardings=stacked)()
    return jnp.zeros((n, *a.shape), a.dtype)


def stack_layers(layers: Callable[[int], QuantizedWeight], n: int) -> QuantizedWeight:
    """n layers' matrices (made one at a time by `layers`) written in place into one stacked QuantizedWeight:
    the device holds the stack and one layer's temporaries, never a second copy of the stack."""
    first = layers(0)
    stacked = QuantizedWeight(_stack_of(first.values, n), _stack_of(first.scale, n), first.block)
    stacked = _put_layer(stacked, first, jnp.int32(0))
    for i in range(1, n):
        layer = layers(i)
        if layer.block != first.block or layer.scale.shape != first.scale.shape:
            raise QuantizationError(f"layer {i}'s scales are laid out unlike layer 0's")
        stacked = _put_layer(stacked, layer, jnp.int32(i))
    return stacked


def weight_bytes(params: dict, tied: bool = False) -> tuple[int, int]:
    """(bytes the parameters hold, bytes the float model would hold in the dtype of the float parameters).
    tied: the model ties its embeddings (a quantized lm_head beside "embed" is then a copy the float model lacks)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, QuantizedWeight))
    floats = [a for a in leaves if not isinstance(a, QuantizedWeight) and jnp.issubdtype(a.dtype, jnp.floating)]
    itemsize = floats[0].dtype.itemsize if floats else 2
    held = sum(a.nbytes for a in leaves)
    unquantized = sum(a.values.size * itemsize if isinstance(a, QuantizedWeight) else a.nbytes for a in leaves)
    head = params.get("lm_head")
    if tied and isinstance(head, QuantizedWeight):
        unquantized -= head.values.size * itemsize
    return held, unquantized


def describe(params: dict, tied: bool = False) -> str:
    """The weights' dtype and bytes for the start-up summary, e.g. "int8 weights (4.1 GB, bfloat16 would be
    8.0 GB)" or "bfloat16 weights (8.0 GB)"."""
    leaves = jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, QuantizedWeight))
    quantized = sorted({jnp.dtype(a.dtype).name for a in leaves if isinstance(a, QuantizedWeight)})
    floats = [a for a in leaves if not isinstance(a, QuantizedWeight) and jnp.issubdtype(a.dtype, jnp.floating)]
    float_name = jnp.dtype(floats[0].dtype).name if floats else "float"
    held, unquantized = weight_bytes(params, tied)
    if not quantized:
        return f"{float_name} weights ({_size(held)})"
    names = "/".join("int8" if n == "int8" else "fp8" for n in quantized)
    return f"{names} weights ({_size(held)}, {float_name} would be {_size(unquantized)})"


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e4 else f"{n} B"
