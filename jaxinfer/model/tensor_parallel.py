"""Tensor parallelism (Megatron's layout) over a one-axis device mesh: the partition of each weight, its loading
straight into the shards, the KV cache's, and the layers under `shard_map`.

Every weight Rule of the declarative map (model/weights.py) names how its tensor splits over the N devices:
    None   replicated (norms, position embeddings, the biases added after an all-reduce);
    "out"  rows split: each source's rows cut in N contiguous parts, padded with zero rows to a multiple of N,
           device d holding part d of every source (gate|up: its own gate rows then its own up rows; the
           vocabulary of embed and lm_head);
    "gate_up" rows of a fused gate|up tensor (one source of 2I rows, Phi-3's gate_up_proj) split as "out" splits
           two sources: device d holds its own gate rows then its own up rows;
    "in"   columns split the same way (down: the intermediate columns);
    "qkv"  rows by attention head: device d holds its q heads' rows, then its KV heads', then its V heads';
    "heads" columns by q head (o_proj): device d's q heads' columns.
Heads split evenly where there are at least N of them; where there are fewer, each head is held by a group of
N / heads devices (the KV cache "replicated in groups"): every device of the group computes the head's attention,
and all but the first hold zero o_proj columns for it, so the all-reduce after o_proj counts it once. Zero
padding (the MLP's width, the vocabulary) is exact: silu(0) * 0 and gelu(0) are 0, and padded logits are cut off.

Inside `shard_map` each device runs the same forward pass on a local ModelConfig (its heads, KV heads and MLP
width) and an op set whose output projections all-reduce (ops.tensor_parallel); outside it the embedding,
final norm and sampling run under the mesh as XLA partitions them, and the lm_head is a vocabulary-parallel
product (logits stay sharded by vocabulary; greedy argmax and the sums of sampling reduce across the shards).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kv_cache import KVCache, bytes_per_page
from jaxinfer.model.quantize import stack_layers
from jaxinfer.model.weights import RULES, Rule
from jaxinfer.ops.pallas import OpSet
from jaxinfer.ops.quantized import QuantizedWeight, quantize

AXIS = "tp"   # the mesh's one axis
SHARDS = (None, "out", "gate_up", "in", "qkv", "heads")


class TensorParallelError(ValueError):
    """A model and a tensor-parallel size that do not fit together."""


def check(cfg: ModelConfig, n: int) -> None:
    """One clear error where the model cannot be split over n devices."""
    if n < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {n}")
    if n == 1:
        return
    for what, heads in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads)):
        if heads % n and n % heads:
            raise TensorParallelError(
                f"tensor_parallel_size {n} does not fit the model's {heads} {what}: one must divide the other "
                f"(sizes that work: {', '.join(str(k) for k in _workable(cfg))})")


def _workable(cfg: ModelConfig) -> list[int]:
    ok = lambda k, h: h % k == 0 or k % h == 0
    return [k for k in (1, 2, 4, 8, 16, 32) if ok(k, cfg.num_heads) and ok(k, cfg.num_kv_heads)]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _heads_of(total: int, n: int, d: int) -> list[int]:
    """Device d's heads of `total` split over n (a group of n / total devices shares one where total < n)."""
    if total >= n:
        per = total // n
        return list(range(d * per, (d + 1) * per))
    return [d * total // n]


def _owns(total: int, n: int, d: int) -> bool:
    """Whether device d is the first of its head's group (it alone counts the head in the all-reduce)."""
    return total >= n or d % (n // total) == 0


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model as one device of n sees it inside shard_map: its heads, KV heads and MLP width."""
    if n == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=max(cfg.num_heads // n, 1), num_kv_heads=max(cfg.num_kv_heads // n, 1),
                               intermediate_size=_ceil_div(cfg.intermediate_size, n),
                               moe_intermediate_size=_ceil_div(cfg.moe_intermediate_size, n))


def cache_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model as the sharded KV cache is allocated for it: each device's KV heads, times n."""
    return dataclasses.replace(cfg, num_kv_heads=local_config(cfg, n).num_kv_heads * n)


def device_page_bytes(cfg: ModelConfig, n: int, page_size: int, dtype: Any = None) -> int:
    """K and V bytes of one page on each of n devices (KV heads held in groups count once per device)."""
    return bytes_per_page(cache_config(cfg, n), page_size, dtype) // n


def order(shard: str | None, cfg: ModelConfig, n: int, sizes: list[int]) -> np.ndarray | None:
    """The global layout of a sharded axis: for each position, the row (or column) of the sources' concatenation
    it holds, -1 where it holds zeros. sizes: the sources' extents along the axis. None: no reordering."""
    if shard is None or n == 1:
        return None
    if shard == "gate_up":   # one fused [gate; up] source: its two halves split as two sources would be
        if len(sizes) != 1 or sizes[0] % 2:
            raise TensorParallelError(f"a gate_up-sharded tensor is one source of 2 x I rows, got {sizes}")
        sizes = [sizes[0] // 2] * 2
    offsets = np.cumsum([0] + sizes[:-1])
    if shard in ("out", "gate_up", "in"):
        parts = []
        for d in range(n):
            for off, size in zip(offsets, sizes):
                c = _ceil_div(size, n)
                idx = np.arange(d * c, (d + 1) * c)
                parts.append(np.where(idx < size, off + idx, -1))
        return np.concatenate(parts)
    hd, q, kv = cfg.head_dim, cfg.q_size, cfg.kv_size
    heads = lambda hs, base: np.concatenate([base + h * hd + np.arange(hd) for h in hs])
    if shard == "qkv":
        if sum(sizes) != q + 2 * kv:
            raise TensorParallelError(f"a qkv-sharded tensor of {sum(sizes)} rows, expected {q + 2 * kv}")
        return np.concatenate([np.concatenate([heads(_heads_of(cfg.num_heads, n, d), 0),
                                               heads(_heads_of(cfg.num_kv_heads, n, d), q),
                                               heads(_heads_of(cfg.num_kv_heads, n, d), q + kv)]) for d in range(n)])
    if shard == "heads":
        return np.concatenate([heads(_heads_of(cfg.num_heads, n, d), 0) if _owns(cfg.num_heads, n, d)
                               else np.full(len(_heads_of(cfg.num_heads, n, d)) * hd, -1) for d in range(n)])
    raise ValueError(f"unknown shard {shard!r} (one of {SHARDS})")


def _axis(shard: str | None) -> int | None:
    """The sharded axis of a rule's [out, in] matrix (or vector)."""
    return None if shard is None else 1 if shard in ("in", "heads") else 0


def _lead(rule: Rule) -> int:
    """The leading axes a rule's tensor stacks its matrices on (layers, then experts): never sharded."""
    return int(rule.per_layer) + int(rule.per_expert)


def spec(shard: str | None, lead: int) -> P:
    """A rule's PartitionSpec over the mesh (`lead` leading layer and expert axes unsharded)."""
    axis = _axis(shard)
    dims = [] if axis is None else [None] * axis + [AXIS]
    return P(*([None] * lead + dims))


@functools.cache
def param_specs(cfg: ModelConfig) -> dict:
    """The parameter tree's PartitionSpecs, one per tensor, from the weight map's rules (those that apply)."""
    tree: dict = {}
    for rule in [r for r in RULES[cfg.family] if r.when(cfg)]:
        node = tree
        *parents, leaf = rule.dest.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = spec(rule.shard, _lead(rule))
    return tree


def load_sharded(rule: Rule, cfg: ModelConfig, read: Callable[[str, tuple, bool], np.ndarray], dtype: Any,
                 mesh: Mesh, per_layer: bool = False) -> jax.Array | list[jax.Array]:
    """A rule's tensor laid out for the mesh and made shard by shard: each device's block is read from the mapped
    files alone (a process touches only the bytes of its own devices' slices). per_layer: a layer matrix as one
    array per layer (weights.load_params' split layers)."""
    if per_layer and rule.per_layer and len(rule.shapes(cfg)[0]) == 2:
        return [load_sharded(dataclasses.replace(rule, sources=tuple(s.replace("{i}", str(i)) for s in rule.sources)),
                             cfg, read, dtype, mesh) for i in range(cfg.num_layers)]
    n = mesh.size
    shapes = [tuple(s) for s in rule.shapes(cfg)]
    axis = _axis(rule.shard)
    natural = (sum(s[0] for s in shapes), *shapes[0][1:])
    if axis is not None and axis >= len(natural):
        raise TensorParallelError(f"{rule.dest}: shard {rule.shard!r} of a {len(natural)}-D tensor")
    sizes = [s[axis] for s in shapes] if axis == 0 else [natural[axis]] if axis is not None else []
    idx = order(rule.shard, cfg, n, sizes)
    shape = list(natural)
    if idx is not None:
        shape[axis] = len(idx)
    # the stacking axes: layers "{i}", then experts "{e}" (each expert's matrix split as a dense one is)
    keys = [k for k, on in (("i", rule.per_layer), ("e", rule.per_expert)) if on]
    lead = [cfg.num_layers if k == "i" else cfg.num_experts for k in keys]

    def block(index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(lead) + len(shape) - len(index))
        stacked = [range(size)[s] for size, s in zip(lead, index)]   # the block's layers (and experts)
        local = index[len(lead):]
        want = [np.arange(dim)[s] for dim, s in zip(shape, local)]
        out = np.zeros((*(len(sel) for sel in stacked), *(len(w) for w in want)), dtype)
        rows = want[0] if idx is None or axis != 0 else idx[want[0]]
        for at_stack in itertools.product(*(range(len(sel)) for sel in stacked)):
            dest = out[at_stack]   # one matrix (or vector) of the block: a view
            names = {k: sel[j] for k, sel, j in zip(keys, stacked, at_stack)}
            off = 0
            for src, shp in zip(rule.sources, shapes):
                mine = (rows >= off) & (rows < off + shp[0])
                if mine.any():
                    arr = read(src.format(**names), shp, rule.transpose)
                    at = np.nonzero(mine)[0]
                    if len(shape) == 2:   # only the block's own elements are copied out of the mapped file
                        cols = want[1] if idx is None or axis != 1 else idx[want[1]]
                        keep = np.nonzero(cols >= 0)[0]
                        dest[np.ix_(at, keep)] = arr[np.ix_(rows[mine] - off, cols[keep])]
                    else:
                        dest[at] = arr[rows[mine] - off]
                off += shp[0]
        return out

    sharding = NamedSharding(mesh, spec(rule.shard, len(lead)))
    return jax.make_array_from_callback(tuple(lead + shape), sharding, block)


# 8-bit weights (ops.quantized.QuantizedWeight) split as their rule splits the matrix: the values exactly so; one
# scale an output channel with its row where rows are split ("out", "qkv", "gate_up"), whole on every device where
# columns are ("in", "heads": the channel's scale multiplies each device's partial sum, and their all-reduce is the
# whole row's product); block scales with their blocks, on a grid fine enough that no block straddles two devices
# or a reordering (head by head, the padding). Quantizing at load computes each row's scale over the whole row, so
# the 8-bit model is the one TP 1 holds, laid out for the mesh.

def scale_spec(values_spec: P, scale_ndim: int, block: tuple[int, int] | None) -> P:
    """The PartitionSpec of a QuantizedWeight's scale, given its values' spec: the same for block scales (one per
    block of rows and columns), the values' without the column axis for one scale an output channel."""
    return values_spec if block is not None else P(*tuple(values_spec)[:scale_ndim])


def quantized_specs(values_spec: P, q: QuantizedWeight) -> QuantizedWeight:
    """A QuantizedWeight of PartitionSpecs (shard_map's in_specs) for q, its values split as `values_spec` says."""
    return QuantizedWeight(values_spec, scale_spec(values_spec, q.scale.ndim, q.block), q.block)


def quantize_sharded(w: jax.Array, rule: Rule, fmt: str, mesh: Mesh) -> QuantizedWeight:
    """A float matrix (stack) laid out for the mesh by load_sharded, quantized in place as ops.quantized.quantize
    quantizes (each row's scale from the whole row: an all-reduce of its max where columns are split)."""
    vspec = spec(rule.shard, w.ndim - 2)
    return _sharded_quantizer(fmt, NamedSharding(mesh, vspec),
                              NamedSharding(mesh, scale_spec(vspec, w.ndim - 1, None)))(w)


@functools.cache
def _sharded_quantizer(fmt: str, values: NamedSharding, scales: NamedSharding):
    """One jitted quantizer per format and layout, so the matrices of one shape and layout (every layer's) compile
    once: a fresh jax.jit a call compiled each of them again."""
    return jax.jit(functools.partial(quantize, fmt=fmt), out_shardings=QuantizedWeight(values, scales))


def _take(a: np.ndarray, idx: np.ndarray, axis: int, fill: float = 0) -> np.ndarray:
    """a's entries at idx along axis (order's layout), `fill` where idx is -1."""
    out = np.take(a, np.maximum(idx, 0), axis=axis)
    missing = (idx < 0).reshape([-1 if d == axis else 1 for d in range(a.ndim)])
    return np.where(missing, np.asarray(fill, a.dtype), out)


def _block_grid(idx: np.ndarray, block: int, local: int) -> tuple[int, np.ndarray]:
    """For block scales along a reordered axis: the largest b dividing `block` for which every run of b positions
    of `idx` is one device's (b divides `local`, each device's extent) and either all padding or b consecutive
    source positions from a multiple of b (so inside one block); and each run's block index (-1: padding)."""
    for b in sorted((d for d in range(1, block + 1) if block % d == 0), reverse=True):
        if local % b:
            continue
        runs = idx.reshape(-1, b)
        first = runs[:, 0]
        pad = (runs < 0).all(axis=1)
        ok = pad | ((first % b == 0) & (runs == first[:, None] + np.arange(b)).all(axis=1))
        if ok.all():
            return b, np.where(pad, -1, first // block)
    raise AssertionError("a grid of one position always fits")


def place_quantized(q: QuantizedWeight, rule: Rule, cfg: ModelConfig, mesh: Mesh) -> QuantizedWeight:
    """A pre-quantized matrix read on the host (numpy values [..., N, K] with its scales, its sources joined in the
    checkpoint's order: model.quantize.read_joined) laid out for the mesh and made shard by shard."""
    n = mesh.size
    lead = q.values.ndim - 2
    axis = _axis(rule.shard)
    shapes = [tuple(s) for s in rule.shapes(cfg)]
    sizes = [s[axis] for s in shapes] if axis == 0 else [shapes[0][axis]] if axis is not None else []
    idx = order(rule.shard, cfg, n, sizes)
    values, scale, block = np.asarray(q.values), np.asarray(q.scale, np.float32), q.block
    if idx is not None:
        values = _take(values, idx, lead + axis)
        if block is None:
            scale = _take(scale, idx, lead + axis, fill=1) if axis == 0 else scale
        else:
            grid, at = _block_grid(idx, block[axis], len(idx) // n)
            scale = _take(scale, at, lead + axis, fill=1)
            block = (grid, block[1]) if axis == 0 else (block[0], grid)
    vspec = spec(rule.shard, lead)
    specs = quantized_specs(vspec, QuantizedWeight(values, scale, block))

    def made(a: np.ndarray, s: P) -> jax.Array:
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, s), lambda index: a[index])

    return QuantizedWeight(made(values, specs.values), made(scale, specs.scale), block)


def load_quantized(rule: Rule, cfg: ModelConfig, one: Callable[[Rule], QuantizedWeight], per_layer: bool = False
                   ) -> QuantizedWeight | list[QuantizedWeight]:
    """An 8-bit rule's tensor over the mesh, a layer at a time: `one` makes the QuantizedWeight of a rule without
    layers (quantize_sharded or place_quantized of its tensor); the layers stacked in place (model.quantize.
    stack_layers), or one per layer (per_layer, split layers)."""
    if not rule.per_layer:
        return one(rule)
    layer = lambda i: one(dataclasses.replace(rule, sources=tuple(s.replace("{i}", str(i)) for s in rule.sources)))
    if per_layer:
        return [layer(i) for i in range(cfg.num_layers)]
    return stack_layers(layer, cfg.num_layers)


def allocate_kv(cfg: ModelConfig, mesh: Mesh | None, num_pages: int, page_size: int, dtype: Any = None) -> KVCache:
    """The KV cache, sharded by KV head over the mesh (each device allocates only its own heads)."""
    if mesh is None:
        return KVCache.allocate(cfg, num_pages, page_size, dtype)
    full = cache_config(cfg, mesh.size)
    shape = jax.eval_shape(lambda: KVCache.allocate(full, num_pages, page_size, dtype))
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P(None, AXIS)), shape)
    return jax.jit(lambda: KVCache.allocate(full, num_pages, page_size, dtype), out_shardings=shardings)()


def run_layers_sharded(run_layers: Callable, cfg: ModelConfig, ops: OpSet, params: dict, kv: KVCache, x: jax.Array,
                       *token_arrays: jax.Array, **options: Any):
    """transformer.run_layers over the mesh of `ops` (ops.tensor_parallel.ShardedOps): each device runs the layers
    on its shards with the local config and the all-reducing op set. token_arrays: positions, slot_mapping,
    token_seq, page_table; options: run_layers' keywords after them."""
    mesh = ops.mesh
    local = local_config(cfg, mesh.size)
    capture = options.get("capture", ())
    cache_spec = P(None, AXIS)
    rope_long = options.pop("rope_long", None)   # LongRoPE's per-sequence choice: an array, so one more argument
    if rope_long is not None:
        token_arrays = (*token_arrays, rope_long)

    def body(layers, k, v, x, *arrays):
        kv_local = kv.replace(k=k, v=v)
        named = options if rope_long is None else {**options, "rope_long": arrays[-1]}
        arrays = arrays if rope_long is None else arrays[:-1]
        kv_out, x, *states = run_layers(local, ops.shard_ops, layers, kv_local, x, *arrays, **named)
        return (kv_out.k, kv_out.v, x, *states)

    layers = {k: params[k] for k in ("layers", "layer_vectors") if k in params}
    in_specs = (layer_specs(cfg, layers), cache_spec, cache_spec, P(), *([P()] * len(token_arrays)))
    out_specs = (cache_spec, cache_spec, P(), *([P()] if capture else []))
    k, v, x, *states = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        layers, kv.k, kv.v, x, *token_arrays)
    return (kv.replace(k=k, v=v), x, *states)


def layer_specs(cfg: ModelConfig, layers: dict) -> dict:
    """The specs of the layer parameters as they are held: stacked ({"layers": tree of [L, ...]}), or split
    (transformer.split_layers: "layers" a list of per-layer matrix trees, "layer_vectors" the stacked rest); an 8-bit
    matrix's (a QuantizedWeight) for its values and its scales (quantized_specs)."""
    stacked = param_specs(cfg)["layers"]

    def walk(node, rules, drop_layer_axis: bool):
        if node is None:
            return None
        if isinstance(node, QuantizedWeight):
            return quantized_specs(P(*rules[1:]) if drop_layer_axis else rules, node)
        if isinstance(node, dict):
            return {k: walk(v, rules[k], drop_layer_axis) for k, v in node.items()}
        return P(*rules[1:]) if drop_layer_axis else rules

    if not isinstance(layers["layers"], (list, tuple)):
        return {"layers": walk(layers["layers"], stacked, False)}
    return {"layers": [walk(layer, stacked, True) for layer in layers["layers"]],
            "layer_vectors": walk(layers["layer_vectors"], stacked, False)}


def sharded_logits(ops: OpSet, h: jax.Array, w: Any, vocab_size: int) -> jax.Array:
    """The vocabulary-parallel lm_head: each device's logits [R, V / N] by its own kernel, left sharded by
    vocabulary (no gather); the padding beyond `vocab_size` cut off."""
    logits = jax.shard_map(lambda h, w: ops.logits(h, w), mesh=ops.mesh, in_specs=(P(), P(AXIS)),
                           out_specs=P(None, AXIS), check_vma=False)(h, w)
    return logits if logits.shape[-1] == vocab_size else logits[:, :vocab_size]
