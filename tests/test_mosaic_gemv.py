"""The Mosaic GPU decode GEMV (pallas/mosaic_gemv.py; an experiment, not in the ops) against its twin in Mosaic GPU's
interpret mode at several batches, shapes and both epilogues, its shape checks, and its lowering for the H200 at
Qwen3-4B's products (only the griddepcontrol variant marked `uses_pdl`). bench/kernels_mosaic_gemv.py times it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.pallas.mosaic_gemv import mosaic_gemv, reference


@pytest.mark.parametrize("T, N, K, epilogue", [(1, 128, 256, "none"), (3, 256, 192, "swiglu"), (8, 64, 128, "none"),
                                                (12, 192, 64, "none"), (16, 128, 128, "swiglu"), (1, 128, 256, "residual"),
                                                (5, 64, 128, "residual"), (12, 128, 64, "residual")])
def test_matches_its_twin(T, N, K, epilogue):
    """bf16 products of float32 sums rounded once: equal to the twin's up to the sums' order (K <= 256 here)."""
    rng = np.random.default_rng(T * 1000 + N + K)
    x = jnp.asarray(rng.standard_normal((T, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, N, K)) / np.sqrt(K), jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((T, N)), jnp.bfloat16) if epilogue == "residual" else None
    # pdl: left out in interpret mode
    y = mosaic_gemv(x, w, 2, residual=res, epilogue=epilogue, pdl=True, interpret=True)
    ref = reference(x, w, 2, epilogue, res)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    err = float(jnp.linalg.norm((y - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
    assert err < 1e-2, err


def test_rejects_what_it_does_not_tile():
    x = jnp.ones((1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="not supported"):
        mosaic_gemv(x, jnp.ones((96, 128), jnp.bfloat16), interpret=True)        # rows not by 64
    with pytest.raises(ValueError, match="not supported"):
        mosaic_gemv(jnp.ones((17, 128), jnp.bfloat16), jnp.ones((64, 128), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        mosaic_gemv(x, jnp.ones((64, 64), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="residual"):
        mosaic_gemv(x, jnp.ones((64, 128), jnp.bfloat16), epilogue="residual", interpret=True)
    with pytest.raises(ValueError, match="residual"):
        mosaic_gemv(x, jnp.ones((64, 128), jnp.bfloat16), residual=jnp.ones((1, 32), jnp.bfloat16),
                    epilogue="residual", interpret=True)


@pytest.mark.parametrize("N, K, epilogue", [(6144, 2560, "none"), (19456, 2560, "swiglu"), (2560, 4096, "residual"),
                                             (2560, 9728, "residual")])
def test_lowers_at_qwen3_4b_products(N, K, epilogue):
    """Shared memory fits (x resident: 8 rows of 9,728 for down) and griddepcontrol marks the module."""
    sd = jax.ShapeDtypeStruct
    res = {"residual": sd((1, N), jnp.bfloat16)} if epilogue == "residual" else {}
    for pdl in (False, True):
        text = jax.jit(functools.partial(mosaic_gemv, layer=0, epilogue=epilogue, pdl=pdl)).trace(
            sd((1, K), jnp.bfloat16), sd((1, N, K), jnp.bfloat16), **res).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu_v2" in text
        assert ("uses_pdl" in text) == pdl
