"""The op interface in jax.numpy: the source of truth that Pallas kernels are checked against.

Every op takes and returns arrays in the model's dtype; products and reductions accumulate in
float32 and round where Hugging Face transformers rounds, so float32 runs match it to ~1e-6.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops import weight
from jaxinfer.ops.quantized import QuantizedWeight
from jaxinfer.ops.quantized_cache import read_rows, write_rows

f32 = jnp.float32
# float32 products in full float32 (XLA on GPUs would otherwise use TF32); no effect on bf16 inputs.
HIGHEST = jax.lax.Precision.HIGHEST


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    h = x.astype(f32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight(scale) * h.astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    h = x.astype(f32)
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(var + eps)
    return (h * weight(scale).astype(f32) + weight(bias).astype(f32)).astype(x.dtype)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x [T, in] @ w[out, in].T (+ b) with float32 accumulation; w may be a LayerWeight, and either may hold a
    QuantizedWeight (quantized_product)."""
    dims = (((1,), (1,)), ((), ()))
    if isinstance(weight(w), QuantizedWeight):
        y = quantized_product(x, weight(w))
        return (y if b is None else y + weight(b).astype(f32)).astype(x.dtype)
    if b is None:
        # The GEMM accumulates in float32 and rounds once to x.dtype either way; asking for x.dtype
        # lets cuBLAS write bf16 itself (a float32 [T, out] output and a convert kernel cost 10-15%
        # of a 1k-token prefill on the H200).
        return jax.lax.dot_general(x, weight(w), dims, precision=HIGHEST, preferred_element_type=x.dtype)
    y = jax.lax.dot_general(x, weight(w), dims, precision=HIGHEST, preferred_element_type=f32)
    if b is not None:
        y = y + weight(b).astype(f32)
    return y.astype(x.dtype)


def rms_norm_linear(x: jax.Array, scale: jax.Array, eps: float, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """linear(rms_norm(x)): the norm as the prologue of the projection that follows it."""
    return linear(rms_norm(x, scale, eps), w, b)


def rms_norm_swiglu(x: jax.Array, scale: jax.Array, eps: float, w_gate_up: jax.Array) -> jax.Array:
    """silu(gate) * up of the fused [2I, D] gate/up projection of rms_norm(x): [T, I]."""
    return swiglu(rms_norm_linear(x, scale, eps, w_gate_up))


def linear_out(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """linear for an output projection (o_proj, down) whose result is normed before it joins the residual stream
    (Gemma 3's sandwich norms): a tensor-parallel op set sums its row-split partial products here."""
    return linear(x, w, b)


def linear_residual(x: jax.Array, w: jax.Array, b: jax.Array | None, residual: jax.Array) -> jax.Array:
    """residual + linear(x): the projection rounds to x.dtype, then the add rounds again (as transformers)."""
    return residual + linear(x, w, b)


def linear_residual_norm_swiglu(x: jax.Array, w: jax.Array, b: jax.Array | None, residual: jax.Array,
                                scale: jax.Array, eps: float, w_gate_up: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The attention's output projection into the residual stream, then the MLP's norm and gate/up:
    (r, silu(gate) * up of rms_norm(r)) with r = linear_residual(x, w, b, residual)."""
    r = linear_residual(x, w, b, residual)
    return r, rms_norm_swiglu(r, scale, eps, w_gate_up)


def logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """The lm_head product, kept in float32 for sampling; w may be a QuantizedWeight (or a LayerWeight)."""
    if isinstance(weight(w), QuantizedWeight):
        return quantized_product(x, weight(w))
    return jax.lax.dot_general(x, weight(w), (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=f32)


def quantized_product(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [T, in] @ (w.values * w.scale).T in float32 [T, out]. Per-channel scales: the 8-bit values in x's dtype
    (exact: int8 and e4m3 fit bfloat16), the product accumulated in float32, then each output channel times its
    scale, once. Block scales: the matrix dequantized in float32 and rounded to x's dtype, as transformers dequantizes
    such checkpoints (a scale per block cannot leave the sum); in float32 that is values * scale exactly."""
    dims = (((1,), (1,)), ((), ()))
    if w.block is not None:
        return jax.lax.dot_general(x, w.dequantize(x.dtype), dims, precision=HIGHEST, preferred_element_type=f32)
    y = jax.lax.dot_general(x, w.values.astype(x.dtype), dims, precision=HIGHEST, preferred_element_type=f32)
    return y * w.scale.astype(f32)


def swiglu(gate_up: jax.Array) -> jax.Array:
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def gelu(x: jax.Array, approximate: bool) -> jax.Array:
    return jax.nn.gelu(x, approximate=approximate)


def geglu(gate_up: jax.Array) -> jax.Array:
    """gelu_tanh(gate) * up of the fused [T, 2I] gate/up projection (Gemma's MLP)."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.gelu(gate, approximate=True) * up


def xielu(x: jax.Array, params: jax.Array) -> jax.Array:
    """Apertus' xIELU activation in float32 (transformers' XIELUActivation); params [4] (or a LayerWeight of them):
    alpha_p and alpha_n before their softplus, beta, eps."""
    p = weight(params).astype(f32)
    beta, eps = p[2], p[3]
    alpha_p, alpha_n = jax.nn.softplus(p[0]), beta + jax.nn.softplus(p[1])
    h = x.astype(f32)
    out = jnp.where(h > 0, alpha_p * h * h + beta * h, (jnp.expm1(jnp.minimum(h, eps)) - h) * alpha_n + beta * h)
    return out.astype(x.dtype)


def moe_route(x: jax.Array, router: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """A mixture of experts' routing of the rows x [T, D] (normed): the router's logits in x's dtype, softmax in
    float32, the top_k experts of each row (ties to the lower index, as torch.topk). Returns (weights [T, top_k]
    float32, renormalised to sum to 1 if asked; experts [T, top_k] int32)."""
    return route(linear(x, router), top_k, renormalize)


def route(logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """moe_route from the router's logits [T, E] (the Pallas ops make them with their own product)."""
    probs = jax.nn.softmax(logits.astype(f32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """The T * top_k (row, expert) assignments of experts [T, top_k] in expert order: (order [T * top_k], the
    flat assignment index of each sorted row, so that its token is order // top_k; group_sizes [E] int32)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


# ragged_dot over our [E, out, in] expert stacks: rows grouped by expert, contracted with each group's matrix's in
_EXPERT_DOT = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                                lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def grouped_linear(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, in] (rows sorted by group, group_sizes [E] of them each, rows past their sum zero) @ w[group].T for
    w [E, out, in] (or a LayerWeight of a [L, E, out, in] stack): [M, out] in x's dtype, accumulated in float32.
    8-bit w (a QuantizedWeight [E, out, in]): as quantized_product, per-channel scales [E, out] after the product of
    the values in x's dtype (exact), each row's sums times its group's scales; block scales on the experts
    dequantized to x's dtype."""
    w = weight(w)
    channel_scales = isinstance(w, QuantizedWeight) and w.block is None
    # block scales: the experts dequantized to x's dtype first, as quantized_product does
    matrices = w if not isinstance(w, QuantizedWeight) else w.values.astype(x.dtype) if channel_scales else \
        w.dequantize(x.dtype)
    y = jax.lax.ragged_dot_general(x, matrices, group_sizes, _EXPERT_DOT, precision=HIGHEST,
                                   preferred_element_type=f32)
    if channel_scales:   # each row's sums times its group's channel scales (rows past the groups: zeros)
        group = jnp.repeat(jnp.arange(w.shape[0], dtype=jnp.int32), group_sizes, total_repeat_length=x.shape[0])
        y = y * w.scale[jnp.minimum(group, w.shape[0] - 1)]
    return y.astype(x.dtype)


def moe_mlp(x: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, top_k: int,
            renormalize: bool, residual: jax.Array | None = None) -> jax.Array:
    """A mixture of SwiGLU experts on the normed rows x [T, D]: router [E, D], w_gate_up [E, 2I, D] (gate rows
    first), w_down [E, D, I] (each may be a LayerWeight of its layer stack). Each row goes to its top_k experts
    (moe_route); the assignments sorted by expert run as two grouped GEMMs (grouped_linear); each expert's output
    is rounded to x's dtype, weighted and summed in float32, rounded once. Returns [T, D] (+ residual [T, D], rounded
    again, if given: the residual stream's add, as transformers adds the block's output)."""
    T = x.shape[0]
    weights, experts = moe_route(x, router, top_k, renormalize)
    order, group_sizes = sort_by_expert(experts, weight(w_gate_up).shape[0])
    h = swiglu(grouped_linear(x[order // top_k], w_gate_up, group_sizes))
    y = grouped_linear(h, w_down, group_sizes)
    y = jnp.zeros_like(y).at[order].set(y).reshape(T, top_k, -1)
    out = jnp.sum(y.astype(f32) * weights[..., None], axis=1).astype(x.dtype)
    return out if residual is None else residual + out


def rms_norm_moe_mlp(x: jax.Array, scale: jax.Array, eps: float, router: jax.Array, w_gate_up: jax.Array,
                     w_down: jax.Array, top_k: int, renormalize: bool, residual: bool = True) -> jax.Array:
    """The residual stream x [T, D] plus the mixture of experts (moe_mlp) of rms_norm(x): a layer's whole MoE block,
    so that a kernel may fold the norm into its products. residual=False: the mixture's output alone (a
    tensor-parallel device's partial sum, all-reduced before the residual's add)."""
    return moe_mlp(rms_norm(x, scale, eps), router, w_gate_up, w_down, top_k, renormalize,
                   residual=x if residual else None)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, head_dim] in rotate-half layout (the two halves repeat the frequencies)."""
    freqs = positions.astype(f32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, N, hd]; rotate-half RoPE as Hugging Face Llama applies it."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def write_kv(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Write k, v [T, KVH, hd] into the caches [L, KVH, slots, hd] of `layer` at slot_mapping [T] (either cache
    may be a QuantizedCache: quantized_cache.write_rows)."""
    return write_rows(k_cache, layer, slot_mapping, k), write_rows(v_cache, layer, slot_mapping, v)


def qkv_rope_write(qkv: jax.Array, cos_sin: tuple[jax.Array, jax.Array] | None, q_norm, k_norm, eps: float,
                   k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, slot_mapping: jax.Array,
                   num_heads: int, num_kv_heads: int, with_kv: bool = False) -> tuple[jax.Array, ...]:
    """Everything between the QKV projection and attention: split qkv [T, (H + 2K) * hd] into heads,
    RMSNorm q and k per head (q_norm/k_norm, or None), RoPE (cos_sin, or None), write k and v to
    the caches at slot_mapping. Returns (q [T, H, hd], k_cache, v_cache), and with `with_kv` also the
    k and v written ([T, K, hd] each, in qkv's dtype, before any rounding to the cache's)."""
    T = qkv.shape[0]
    hd = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q, k, v = jnp.split(qkv, [num_heads * hd, (num_heads + num_kv_heads) * hd], axis=-1)
    q, k, v = q.reshape(T, num_heads, hd), k.reshape(T, num_kv_heads, hd), v.reshape(T, num_kv_heads, hd)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    if cos_sin is not None:
        q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
    k_cache, v_cache = write_kv(k_cache, v_cache, layer, k, v, slot_mapping)
    return (q, k_cache, v_cache, k, v) if with_kv else (q, k_cache, v_cache)


def gather_kv(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, slot_mapping: jax.Array,
              dtype) -> tuple[jax.Array, jax.Array]:
    """The K/V rows of slot_mapping [T] (or any shape S) in the caches' `layer`, as [T, KVH, hd] ([*S, KVH, hd]) each
    in `dtype`; a QuantizedCache's rows dequantized (quantized_cache.read_rows)."""
    return read_rows(k_cache, layer, slot_mapping, dtype), read_rows(v_cache, layer, slot_mapping, dtype)


def window_floor(positions: jax.Array, window: jax.Array | int | None) -> jax.Array | int:
    """The first key position that a query at `positions` sees under a sliding `window` (an int32 scalar, 0:
    global; None: no window): keys in (position - window, position]. 0 where the layer is global."""
    if window is None:
        return 0
    return jnp.where(window > 0, positions - window + 1, 0)


def fresh_prompt_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                           implementation: str = "xla", window: jax.Array | int | None = None) -> jax.Array:
    """Causal attention of one fresh prompt over itself: q [T, H, hd], k, v [T, KVH, hd] at positions
    0..T-1 (model.py passes the K/V just written: from qkv_rope_write where the cache holds them as
    computed, gathered back from a float8 cache, as the paged kernels read it). Rows past the prompt
    (padding, at the end) see it and themselves; their output is unused. `implementation`:
    jax.nn.dot_product_attention's ("cudnn": its flash attention on NVIDIA GPUs). `window`: a sliding window
    (window_floor), as a mask through XLA's attention."""
    if window is not None:
        rows = jnp.arange(q.shape[0])
        mask = (rows[None, :] <= rows[:, None]) & (rows[None, :] >= window_floor(rows, window)[:, None])
        return jax.nn.dot_product_attention(q[None], k[None], v[None], mask=mask[None, None], scale=scale,
                                            implementation="xla")[0]
    out = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                       implementation=implementation)
    return out[0]


def prefixed_chunk_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                             page_row: jax.Array, prefix_len: jax.Array, slot_mapping: jax.Array, page_size: int,
                             scale: float, implementation: str = "xla",
                             window: jax.Array | int | None = None) -> jax.Array:
    """Causal attention of one sequence's chunk q [T, H, hd] at positions prefix_len.. over its cached
    prefix (positions < prefix_len, through its pages page_row [P]) and itself (K/V just written at
    slot_mapping [T]), as two attentions merged by their log-sum-exps: the prefix part unmasked but for
    its length, the chunk part causal from its own first row (jax.nn.dot_product_attention's causal mask
    is aligned top-left, so one call over prefix + chunk cannot express it). The prefix is gathered at
    the page row's full span (a static shape), its length given as the keys' valid length. Rows past
    the chunk (padding, at the end) see the prefix, the chunk and themselves; their output is unused.
    `implementation`: "cudnn" (cuDNN's flash attention, which returns its log-sum-exp) or "xla". `window`: a
    sliding window (window_floor; XLA's attention, where a prefix row may see no key: its weight is 0)."""
    part = _cudnn_attention_with_lse if implementation == "cudnn" and window is None else _attention_with_lse
    windowed = {} if window is None else {"window": window}
    prefix_slots = (page_row[:, None] * page_size + jnp.arange(page_size)[None, :]).reshape(-1)
    out_p, lse_p = part(q, *gather_kv(k_cache, v_cache, layer, prefix_slots, q.dtype), scale, causal=False,
                        kv_len=prefix_len, **windowed, **({"q_offset": prefix_len} if windowed else {}))
    out_c, lse_c = part(q, *gather_kv(k_cache, v_cache, layer, slot_mapping, q.dtype), scale, causal=True,
                        **windowed)
    m = jnp.maximum(lse_p, lse_c)     # the chunk part always sees a key: finite
    w_p, w_c = jnp.exp(lse_p - m)[..., None], jnp.exp(lse_c - m)[..., None]
    out = (out_p.astype(f32) * w_p + out_c.astype(f32) * w_c) / (w_p + w_c)
    return out.astype(q.dtype)


# _attention_with_lse's query rows a block: its float32 scores are rows x H x S (a 8,192-token chunk of
# Qwen3-4B over a 32k page row took 32 GB a layer, and XLA's autotuner ran out of memory on it on the H200)
LSE_BLOCK_ROWS = 1024


def _attention_with_lse(q, k, v, scale, causal, kv_len=None, window=None, q_offset=0):
    """q [T, H, hd] over k, v [S, KVH, hd] (grouped heads): (out [T, H, hd], log-sum-exp [T, H] float32;
    -inf where a row sees no key). causal: row t sees keys 0..t; kv_len: only keys < kv_len; window: only keys
    s >= window_floor(q_offset + t, window) (row t at position q_offset + t, key s at s). More than
    LSE_BLOCK_ROWS rows run a block of rows at a time (each row's arithmetic is its own: the same values)."""
    T, H, hd = q.shape
    rows = LSE_BLOCK_ROWS
    if T <= rows:
        return _attention_rows_with_lse(q, k, v, scale, causal, kv_len, 0, window, q_offset)
    n = -(-T // rows)
    qb = jnp.pad(q, ((0, n * rows - T), (0, 0), (0, 0))).reshape(n, rows, H, hd)
    out, lse = jax.lax.map(lambda a: _attention_rows_with_lse(a[0], k, v, scale, causal, kv_len, a[1], window,
                                                              q_offset),
                           (qb, jnp.arange(n, dtype=jnp.int32) * rows))
    return out.reshape(n * rows, H, hd)[:T], lse.reshape(n * rows, H)[:T]


def _attention_rows_with_lse(q, k, v, scale, causal, kv_len, row0, window=None, q_offset=0):
    """_attention_with_lse for query rows row0.. (row0 matters only to the causal mask)."""
    T, H, hd = q.shape
    S, kvh, _ = k.shape
    qg = q.astype(f32).reshape(T, kvh, H // kvh, hd)
    s = jnp.einsum("tkgd,skd->tkgs", qg, k.astype(f32), precision=HIGHEST) * scale
    visible = jnp.ones((T, S), bool)
    if causal:
        visible = jnp.arange(S)[None, :] <= row0 + jnp.arange(T)[:, None]
    if kv_len is not None:
        visible = visible & (jnp.arange(S) < kv_len)[None, :]
    if window is not None:
        floor = window_floor(q_offset + row0 + jnp.arange(T), window)
        visible = visible & (jnp.arange(S)[None, :] >= floor[:, None])
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    denom = jnp.sum(p, axis=-1)
    out = jnp.einsum("tkgs,skd->tkgd", p, v.astype(f32), precision=HIGHEST) / jnp.maximum(denom, 1e-30)[..., None]
    return out.reshape(T, H, hd).astype(q.dtype), (m_safe + jnp.log(denom)).reshape(T, H)


def _cudnn_attention_with_lse(q, k, v, scale, causal, kv_len=None):
    """_attention_with_lse on cuDNN's flash attention (GPUs, 16-bit): its log-sum-exp is the
    `return_residual` of jax's cuDNN call, which jax.nn.dot_product_attention does not expose."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    T, H, _ = q.shape
    if causal:
        kw = dict(mask_type=MaskType.CAUSAL)
    else:
        kw = dict(mask_type=MaskType.PADDING, q_seqlen=jnp.full((1,), T, jnp.int32),
                  kv_seqlen=jnp.reshape(kv_len, (1,)).astype(jnp.int32))
    out, lse = dot_product_attention(q[None], k[None], v[None], scale=scale, qkv_layout="BTNH",
                                     return_residual=True, **kw)
    lse = lse[0]
    if lse.shape == (H, T) and T != H:   # [B, N, T] in jax 0.11.2's lowering; [B, T, N] also documented
        lse = lse.T
    return out[0], lse.astype(f32)


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                    page_table: jax.Array, token_seq: jax.Array, positions: jax.Array,
                    page_size: int, scale: float, chunk: int | None = None,
                    window: jax.Array | int | None = None) -> jax.Array:
    """Causal attention of ragged query tokens over their own sequence's pages.

    q [T, H, hd]; caches [L, KVH, slots, hd]; page_table [B, P]; token_seq [T] (row of page_table
    for each token); positions [T] (a token sees cached positions 0..position; with a sliding `window`,
    window_floor(position)..position).

    Two layouts of the same math, chosen by size: with few sequences the keys of each sequence are
    gathered once ([KVH, B, ctx, hd]) and every query scores all of them, masked to its own; with
    many, each query gathers its own sequence's keys ([chunk, ctx] rows). Queries go in chunks so
    that the scores or gathered keys stay bounded (`chunk`: rows per chunk).
    """
    T, H, hd = q.shape
    kvh = k_cache.shape[1]
    group = H // kvh
    B, P = page_table.shape
    ctx = P * page_size
    slots = (page_table[:, :, None] * page_size + jnp.arange(page_size)[None, None, :]).reshape(B, ctx)
    # Gather straight from the whole cache (layer and slots in one index): slicing out the layer
    # first could make XLA copy that layer's entire pool.
    per_sequence = 2 * B * H <= kvh * hd * q.dtype.itemsize   # scores cost less than gathered keys
    if per_sequence:
        k_seq, v_seq = gather_kv(k_cache, v_cache, layer, slots, q.dtype)   # [B, ctx, KVH, hd], once

    def attend(args):
        qc, seq, pos = args
        floor = window_floor(pos, window) + jnp.zeros_like(pos)
        qg = qc.reshape(qc.shape[0], kvh, group, hd)
        if per_sequence:
            scores = jnp.einsum("tkgd,bckd->tkgbc", qg, k_seq, precision=HIGHEST, preferred_element_type=f32)
            own = seq[:, None] == jnp.arange(B)[None, :]                            # [Tc, B]
            key = jnp.arange(ctx)[None, None, :]
            visible = own[:, :, None] & (key <= pos[:, None, None]) & (key >= floor[:, None, None])
            scores = jnp.where(visible[:, None, None], scores * scale, -jnp.inf)
            shape = scores.shape
            probs = jax.nn.softmax(scores.reshape(*shape[:3], B * ctx), axis=-1).reshape(shape).astype(q.dtype)
            out = jnp.einsum("tkgbc,bckd->tkgd", probs, v_seq, precision=HIGHEST, preferred_element_type=f32)
        else:
            s = slots[seq]                                      # [Tc, ctx]
            k, v = gather_kv(k_cache, v_cache, layer, s, q.dtype)   # [Tc, ctx, KVH, hd]
            scores = jnp.einsum("tkgd,tckd->tkgc", qg, k, precision=HIGHEST, preferred_element_type=f32) * scale
            key = jnp.arange(ctx)[None, :]
            visible = (key <= pos[:, None]) & (key >= floor[:, None])
            scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
            probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
            out = jnp.einsum("tkgc,tckd->tkgd", probs, v, precision=HIGHEST, preferred_element_type=f32)
        return out.reshape(qc.shape[0], H, hd).astype(q.dtype)

    if chunk is None:  # about 256 MiB of float32 scores (or gathered keys) per chunk
        per_row = H * B * ctx * 4 if per_sequence else 2 * kvh * ctx * hd * q.dtype.itemsize
        chunk = max(16, 1 << ((2**28 // per_row).bit_length() - 1) if per_row <= 2**28 else 16)
    if T <= chunk:
        return attend((q, token_seq, positions))
    n = -(-T // chunk)
    pad = n * chunk - T
    qs = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(n, chunk, H, hd)
    seqs = jnp.pad(token_seq, (0, pad)).reshape(n, chunk)
    poss = jnp.pad(positions, (0, pad)).reshape(n, chunk)
    return jax.lax.map(attend, (qs, seqs, poss)).reshape(n * chunk, H, hd)[:T]


def decode_qkv_attention(qkv: jax.Array, cos_sin, q_norm, k_norm, eps: float, k_cache: jax.Array,
                         v_cache: jax.Array, layer: jax.Array, slot_mapping: jax.Array, page_table: jax.Array,
                         context_lens: jax.Array, page_size: int, scale: float, num_heads: int,
                         num_kv_heads: int, window: jax.Array | int | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode step's attention from the QKV projection on: qkv_rope_write for the one new token per
    sequence, then paged_decode_attention over context_lens[b] positions (the new one included; with a
    sliding `window`, the last `window` of them).
    Returns (out [B, H, hd], k_cache, v_cache). An op of its own so that a kernel can do both."""
    q, k_cache, v_cache = qkv_rope_write(qkv, cos_sin, q_norm, k_norm, eps, k_cache, v_cache, layer, slot_mapping,
                                         num_heads, num_kv_heads)
    return (paged_decode_attention(q, k_cache, v_cache, layer, page_table, context_lens, page_size, scale,
                                   window=window), k_cache, v_cache)


def paged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                           page_table: jax.Array, context_lens: jax.Array, page_size: int,
                           scale: float, window: jax.Array | int | None = None) -> jax.Array:
    """One query token per sequence (q [B, H, hd]) over that sequence's first context_lens[b] positions (with a
    sliding `window`: the last `window` of them)."""
    B = q.shape[0]
    return paged_attention(q, k_cache, v_cache, layer, page_table, jnp.arange(B, dtype=jnp.int32),
                           context_lens - 1, page_size, scale, window=window)


def verify_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                     page_table: jax.Array, context_lens: jax.Array, page_size: int, scale: float,
                     window: jax.Array | int | None = None) -> jax.Array:
    """Q query rows per sequence (q [B, Q, H, hd]: a speculative verify step's last token and Q - 1 drafts), their
    K/V already in the cache: row j of sequence b sees positions 0..context_lens[b] - Q + j (context_lens[b]: the
    last row's position + 1; with a sliding `window`, from window_floor of that position). Returns [B, Q, H, hd]."""
    B, Q, H, hd = q.shape
    rows = jnp.arange(Q, dtype=jnp.int32)
    positions = (context_lens[:, None] - Q + rows[None, :]).reshape(B * Q)
    token_seq = jnp.repeat(jnp.arange(B, dtype=jnp.int32), Q)
    out = paged_attention(q.reshape(B * Q, H, hd), k_cache, v_cache, layer, page_table, token_seq,
                          jnp.maximum(positions, 0), page_size, scale, window=window)
    return out.reshape(B, Q, H, hd)
