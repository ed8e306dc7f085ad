"""The persistent MLP block (pallas/mlp_block.py, an experiment the engine does not use) in interpret mode: one
program (interpret mode runs programs in turn, so a grid barrier can only be passed by one), against the two
fused GEMVs it replaces (bit for bit) and the reference ops; its barrier counter as threaded state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxinfer.ops import LayerWeight, reference
from jaxinfer.pallas.fused_gemv import fused_gemv
from jaxinfer.pallas.mlp_block import mlp_block


def _weights(D, I, dtype, seed):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(k[0], (1, D)).astype(dtype)
    wgu = (jax.random.normal(k[1], (3, 2 * I, D)) / np.sqrt(D)).astype(dtype)
    scale = (1 + 0.2 * jax.random.normal(k[2], (3, D))).astype(dtype)
    wd = (jax.random.normal(k[3], (3, D, I)) / np.sqrt(I)).astype(dtype)
    res = jax.random.normal(k[4], (1, D)).astype(dtype)
    return x, wgu, scale, wd, res


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("D, I, block_up, block_down", [(72, 100, 32, 64), (128, 96, 64, 32), (64, 130, 64, 128)])
def test_mlp_block_equals_the_two_fused_gemvs_and_the_reference(D, I, block_up, block_down, dtype):
    x, wgu, scale, wd, res = _weights(D, I, dtype, seed=D + I)
    counter = jnp.zeros((1,), jnp.int32)
    out, counter = mlp_block(x, wgu, scale, wd, res, counter, 2, block_up=block_up, block_down=block_down,
                             programs=1, interpret=True)
    h = fused_gemv(x, wgu, 2, scale=scale, epilogue="swiglu", block_in=block_up, interpret=True)
    two = fused_gemv(h, wd, 2, residual=res, epilogue="residual", block_in=block_down, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(two))
    lw = lambda a: LayerWeight(a, jnp.int32(2))   # noqa: E731
    ref = reference.linear_residual(reference.rms_norm_swiglu(x, lw(scale), 1e-6, lw(wgu)), lw(wd), None, res)
    assert rel_err(out, ref) <= (1e-5 if dtype == jnp.float32 else 2e-2)


def test_the_barrier_counter_is_threaded_state():
    """Each call adds one arrival per program and leaves the counter where the next call's barrier expects it."""
    x, wgu, scale, wd, res = _weights(64, 64, jnp.float32, seed=1)
    counter = jnp.zeros((1,), jnp.int32)
    outs = []
    for layer in (0, 1, 0):
        out, counter = mlp_block(x, wgu, scale, wd, res, counter, layer, block_up=32, block_down=32, programs=1,
                                 interpret=True)
        outs.append(np.asarray(out))
    assert int(counter[0]) == 3
    np.testing.assert_array_equal(outs[0], outs[2])
    assert not np.array_equal(outs[0], outs[1])


def test_bad_arguments():
    x, wgu, scale, wd, res = _weights(64, 64, jnp.float32, seed=2)
    counter = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="programs"):
        mlp_block(x, wgu, scale, wd, res, counter, programs=2, interpret=True)   # would spin forever
    with pytest.raises(ValueError, match="programs"):
        mlp_block(x, wgu, scale, wd, res, counter, programs=3)
    with pytest.raises(ValueError, match="one token"):
        mlp_block(jnp.concatenate([x, x]), wgu, scale, wd, res, counter, programs=1, interpret=True)
    with pytest.raises(ValueError, match="w_down"):
        mlp_block(x, wgu, scale, wd[:, :, :32], res, counter, programs=1, interpret=True)
