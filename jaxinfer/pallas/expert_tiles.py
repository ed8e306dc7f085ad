"""A mixture of experts' prompt rows laid out for the grouped Hopper GEMM (hopper_gemm's `row_tile_group`).

The token-expert assignments are sorted by expert and each expert's rows padded to whole tiles of `tile` rows, so
that no tile holds two experts' rows: tile i of the padded rows multiplies expert tile_expert[i] (-1: past the
last expert's rows, skipped). The padded layout has a static size, the worst case of E partial tiles:
padded_rows(A, E, tile) = A + E * (tile - 1) rounded up to a tile. Padding rows hold zeros; their outputs are
never read. Everything here is a few small XLA ops over int32 arrays of A or E values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def padded_rows(assignments: int, num_experts: int, tile: int) -> int:
    """Rows of the padded layout: room for every expert's rows padded to whole tiles, in any routing."""
    return -(-(assignments + num_experts * (tile - 1)) // tile) * tile


@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    source: jax.Array        # int32 [P]: the assignment (token * top_k + j) each padded row holds; A for padding
    position: jax.Array      # int32 [A]: each assignment's row in the padded layout
    tile_expert: jax.Array   # int32 [P / tile]: the expert of each tile of rows, -1 where it holds none


def expert_tiles(order: jax.Array, group_sizes: jax.Array, tile: int) -> ExpertTiles:
    """The padded layout, `tile` rows a tile, of the assignments sorted by expert as reference.sort_by_expert gives
    them: order [A] (the assignment at each sorted row) and group_sizes [E] (each expert's assignments)."""
    A, num_experts = order.shape[0], group_sizes.shape[0]
    P = padded_rows(A, num_experts, tile)
    counts = group_sizes.astype(jnp.int32)
    padded = -(-counts // tile) * tile
    start = jnp.cumsum(padded) - padded               # each expert's first padded row
    first = jnp.cumsum(counts) - counts               # each expert's first row in sorted order
    sorted_experts = jnp.repeat(jnp.arange(num_experts, dtype=jnp.int32), counts, total_repeat_length=A)
    rank = jnp.arange(A, dtype=jnp.int32) - first[sorted_experts]
    position = jnp.zeros(A, jnp.int32).at[order].set(start[sorted_experts] + rank)
    source = jnp.full(P, A, jnp.int32).at[position].set(jnp.arange(A, dtype=jnp.int32))
    tile_first = jnp.arange(P // tile, dtype=jnp.int32) * tile
    # compare_all: one fusion, not the default method's loop (see grouped_gemm.sorted_items)
    owner = jnp.searchsorted(jnp.cumsum(padded), tile_first, side="right", method="compare_all").astype(jnp.int32)
    tile_expert = jnp.where(tile_first < jnp.sum(padded), owner, -1)
    return ExpertTiles(source, position, tile_expert)


def gather_rows(x: jax.Array, tiles: ExpertTiles, top_k: int) -> jax.Array:
    """x [T, D] -> the padded layout [P, D]: each padded row its assignment's token row, padding rows zeros."""
    T = x.shape[0]
    token = jnp.where(tiles.source < T * top_k, tiles.source // top_k, T)
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[token]
