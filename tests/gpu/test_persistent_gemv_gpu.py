"""The persistent GEMV chain (pallas/persistent_gemv.py) on the GPU: two Qwen3-4B-shaped layers in one launch, every
schedule and CTA count the bench times, against its twin (float32 products rounded to bf16: relative error < 1e-2,
the sums' order differs) and with no CTA's barrier timed out. Runs only where JAX sees a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.pallas import persistent_gemv as PG

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.parametrize("d, q, inter, rows, kw", [
    (2560, 6144, 9728, (4, 2, 2, 1), dict(programs=132, num_warps=8)),
    (2560, 6144, 9728, (4, 2, 2, 1), dict(programs=132, num_warps=8, schedule="tickets")),
    (2560, 6144, 9728, (4, 2, 2, 1), dict(programs=132, num_warps=8, prefetch=0)),
    (2560, 6144, 9728, (2, 1, 1, 1), dict(programs=264, num_warps=4, prefetch=3)),
    (2560, 6144, 9728, (1, 1, 1, 1), dict(programs=528, num_warps=2, prefetch=2)),
    (2560, 6144, 9728, (2, 1, 1, 1), dict(programs=264, num_warps=4, x_in_registers=False)),
    (2560, 6144, 9728, (2, 1, 1, 1), dict(programs=264, num_warps=4, schedule="tickets")),
    (1024, 4096, 3072, (8, 2, 4, 2), dict(programs=132, num_warps=8)),
    (1024, 4096, 3072, (4, 1, 2, 1), dict(programs=132, num_warps=4, schedule="tickets")),
])
def test_matches_its_twin(d, q, inter, rows, kw):
    key = jax.random.PRNGKey(d + q + sum(rows))
    shapes = [(q, d), (d, q), (2 * inter, d), (d, inter)]
    ws = tuple((jax.random.normal(jax.random.fold_in(key, j), (2, n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
               for j, (n, k) in enumerate(shapes))
    x = jax.random.normal(jax.random.fold_in(key, 9), (d,), jnp.float32).astype(jnp.bfloat16)
    y, timed_out = PG.persistent_chain(x, ws, products=PG.layer_products(d, q, inter, rows), **kw)
    assert not np.any(np.asarray(timed_out)), np.asarray(timed_out)
    ref = PG.reference_chain(x, ws)
    err = float(jnp.linalg.norm((y - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
    assert err < 1e-2, err
