"""bench/pdl_mosaic_probe.py on the CPU: its chains of Mosaic GPU kernels add 1 per kernel (interpret mode, without
the griddepcontrol calls, which interpret mode lacks), and lowered for CUDA only the variants with the calls have
their modules marked `uses_pdl` (what the GPU run asks XLA to honour)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.pdl_mosaic_probe import SHAPE, TK, chain, make_weights, stream_chain

SMALL = {"a": (8, 2 * TK), "b": (16, 3 * TK)}


def test_the_chains_add_one_a_kernel():
    x = jnp.zeros(SHAPE, jnp.float32)
    np.testing.assert_array_equal(np.asarray(chain(x, n=2, pdl=False, interpret=True)), 2)
    weights = make_weights(1, ctas=2, layer_shapes=SMALL)
    np.testing.assert_array_equal(np.asarray(stream_chain(x, weights, pdl=False, prefetch=0, interpret=True)), 2)


def test_only_the_griddepcontrol_variants_are_marked_uses_pdl():
    x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    weights = [[jax.ShapeDtypeStruct((132, r, k), jnp.bfloat16) for r, k in SMALL.values()]]
    for pdl in (False, True):
        for f, args in ((functools.partial(chain, n=1, pdl=pdl), (x,)),
                        (lambda x, w, pdl=pdl: stream_chain(x, w, pdl=pdl, prefetch=1), (x, weights))):
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "mosaic_gpu_v2" in text
            assert ("uses_pdl" in text) == pdl


def test_the_stream_chain_lowers_at_the_layer_shapes():
    """The GPU run's shapes (one CTA an SM, Qwen3-4B's projections' rows and widths): shared memory and TMA boxes fit."""
    from bench.pdl_mosaic_probe import CTAS, LAYER

    weights = [[jax.ShapeDtypeStruct((CTAS, r, k), jnp.bfloat16) for r, k in LAYER.values()]]
    x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    for stages in (4, 16):   # 16: capped where a ring of them would not fit
        text = jax.jit(lambda x, w: stream_chain(x, w, pdl=True, prefetch=8, stages=stages)).trace(x, weights).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("mosaic_gpu_v2") == len(LAYER)


def test_the_persistent_chain_adds_one_a_kernel_and_meets_at_each_phase_start():
    from bench.pdl_mosaic_probe import make_flat_weights, persistent_chain, phase_starts

    tiles = (1, 2, 1, 1)
    assert phase_starts(2, tiles) == [1, 3, 4, 5, 6, 8, 9]
    x = jnp.zeros(SHAPE, jnp.float32)
    for per_kernel in (1, 2):
        weights = make_flat_weights(2 // per_kernel, per_kernel, ctas=2, rows=8, phase_tiles=tiles)
        y = persistent_chain(x, weights, per_kernel, barriers=False, phase_tiles=tiles, interpret=True)
        np.testing.assert_array_equal(np.asarray(y), 2 // per_kernel)


def test_the_persistent_kernels_lower_at_the_layer_shapes_with_their_barriers():
    """Interpret mode has no global semaphores: the barrier variant is checked lowered for the H200 (8 layers in one
    kernel: 31 barriers, one kernel; one layer a kernel: 8 kernels), shared memory and TMA boxes fitting."""
    from bench.pdl_mosaic_probe import CTAS, PHASE_TILES, ROWS_P, persistent_chain

    x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    for per_kernel in (1, 8):
        w = [jax.ShapeDtypeStruct((CTAS, ROWS_P, per_kernel * sum(PHASE_TILES) * TK), jnp.bfloat16)] * (8 // per_kernel)
        plain, barriers = (jax.jit(lambda x, w, b=b: persistent_chain(x, w, per_kernel, b)).trace(x, w).lower(
            lowering_platforms=("cuda",)).as_text() for b in (False, True))
        assert plain.count("mosaic_gpu_v2") == barriers.count("mosaic_gpu_v2") == 8 // per_kernel
        assert len(barriers) > len(plain)   # the semaphores' atomics and spins
