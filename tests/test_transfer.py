"""to_device: a pytree of numpy arrays reaches the device in one copy, bit for bit."""

import jax
import numpy as np
import pytest

from jaxinfer.runner.batch import StepBatch
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.sample import SamplingArrays
from jaxinfer.runner.transfer import pack, to_device


def test_round_trip_every_dtype_bit_for_bit():
    rng = np.random.default_rng(0)
    tree = dict(i=rng.integers(-2**31, 2**31 - 1, (3, 5), dtype=np.int32), b=rng.random(7) > 0.5,
                f=np.array([0.1, -0.0, np.inf, np.nan, 1e-40], np.float32),
                u=np.array([0, 2**32 - 1, 12345], np.uint32), s=np.int32(4), e=np.zeros((0, 3), np.int32))
    out = to_device(tree)
    assert set(out) == set(tree)
    for k, v in tree.items():
        got = np.asarray(out[k])
        assert got.dtype == v.dtype and got.shape == np.shape(v), k
        assert got.tobytes() == np.asarray(v).tobytes(), k


def test_step_batch_arrives_whole():
    B, T = 3, 8
    batch = StepBatch(tokens=np.arange(T, dtype=np.int32), positions=np.arange(T, dtype=np.int32),
                      slot_mapping=np.arange(T, dtype=np.int32) + 5, token_seq=np.zeros(T, np.int32),
                      next_tokens=np.zeros(T, np.int32), from_state=np.arange(T) % 3 == 0, page_table=np.arange(B * 4, dtype=np.int32).reshape(B, 4),
                      query_start=np.array([0, 8, 8, 8], np.int32), sample_index=np.array([7, 0, 0], np.int32),
                      emits=np.array([True, False, False]), state_row=np.arange(B, dtype=np.int32),
                      step_index=np.zeros(B, np.int32),
                      sampling=SamplingArrays.from_params([SamplingParams(temperature=0.7, top_p=0.9)], [99], B))
    buf, layout = pack(batch)
    assert buf.dtype == np.int32 and buf.ndim == 1
    out = to_device(batch)
    assert isinstance(out, StepBatch)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(batch)):
        np.testing.assert_array_equal(np.asarray(a), b)
        assert np.asarray(a).dtype == b.dtype


def test_other_dtypes_are_refused():
    with pytest.raises(TypeError, match="float64"):
        pack(dict(x=np.zeros(3)))


def test_a_packed_batch_is_split_inside_the_jitted_step():
    """to_device_packed: one buffer with its layout as static pytree data; `unpacked` inside a jitted function
    gives the pytree bit for bit; each layout compiles once (the same layout twice: one trace)."""
    from jaxinfer.runner.transfer import Packed, to_device_packed, unpacked

    traces = []

    @jax.jit
    def step(packed):
        traces.append(1)
        tree = unpacked(packed)
        return tree["a"].sum() + tree["f"].sum().astype(np.int32), tree

    rng = np.random.default_rng(1)
    for _ in range(2):
        tree = dict(a=rng.integers(0, 100, (4, 3), dtype=np.int32), f=rng.random(5).astype(np.float32),
                    b=rng.random(6) > 0.5)
        packed = to_device_packed(tree)
        assert isinstance(packed, Packed) and len(jax.tree_util.tree_leaves(packed)) == 1
        assert packed.shapes() == dict(a=(4, 3), f=(5,), b=(6,))
        _, out = step(packed)
        for k, v in tree.items():
            assert np.asarray(out[k]).tobytes() == v.tobytes() and out[k].dtype == v.dtype, k
    assert len(traces) == 1
    step(to_device_packed(dict(a=np.zeros((2, 3), np.int32), f=np.zeros(5, np.float32), b=np.zeros(6, bool))))
    assert len(traces) == 2   # another layout: another trace
    assert unpacked(tree) is tree   # not packed: as is
