"""bench/pdl_mosaic_probe.py on the CPU: its chain of Mosaic GPU kernels adds 1 per kernel (interpret mode, without
the griddepcontrol calls, which interpret mode lacks), and lowered for CUDA only the variant with the calls has its
module marked `uses_pdl` (what the GPU run asks XLA to honour)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.pdl_mosaic_probe import SHAPE, chain


def test_the_chain_adds_one_a_kernel():
    y = chain(jnp.zeros(SHAPE, jnp.float32), n=2, pdl=False, interpret=True)
    np.testing.assert_array_equal(np.asarray(y), 2)


def test_only_the_griddepcontrol_variant_is_marked_uses_pdl():
    x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    for pdl in (False, True):
        text = jax.jit(functools.partial(chain, n=1, pdl=pdl)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu_v2" in text
        assert ("uses_pdl" in text) == pdl
