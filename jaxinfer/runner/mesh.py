"""The device mesh of tensor parallelism, and the settings a tensor-parallel engine cannot take.

One process drives the mesh's devices: its own (`jax.local_devices()`), or, after `jax.distributed.initialize`
(runner.distributed), an equal share of every process's (`jax.devices()`): one mesh over all hosts, the same
compiled steps on each.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.tensor_parallel import AXIS, TensorParallelError, check
from jaxinfer.settings import EngineConfig


def make_mesh(tensor_parallel_size: int, cfg: ModelConfig | None = None) -> Mesh | None:
    """A one-axis ("tp") mesh over `tensor_parallel_size` devices (mesh_devices); None for 1 in one process (no
    mesh: the single-device path, unchanged). One clear error where the model `cfg` cannot be split that way
    (checked first: a machine with more devices would not help) or the devices do not fit."""
    n = tensor_parallel_size
    if n < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {n}")
    if n == 1 and jax.process_count() == 1:
        return None
    if cfg is not None:
        check(cfg, n)
    return Mesh(np.array(mesh_devices(jax.devices(), n, jax.process_count())), (AXIS,))


def mesh_devices(devices: list, n: int, processes: int = 1) -> list:
    """The mesh's n devices: the first n / processes of each process's (in process order), so that every process
    of a multi-host run holds its share of the shards and runs the same steps on them."""
    if n % processes:
        raise TensorParallelError(f"tensor_parallel_size {n} over {processes} processes: each process must hold the "
                                  f"same number of the mesh's devices (a multiple of {processes})")
    per = n // processes
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    fewest = min(len(v) for v in by_process.values())
    if per > fewest:
        where = f"in each of {processes} processes" if processes > 1 else "on this machine"
        raise TensorParallelError(f"tensor_parallel_size {n} needs {per} devices {where}; there are {fewest} "
                                  f"({devices[0].platform}: {len(devices)} in {processes} process(es))")
    return [d for p in sorted(by_process) for d in by_process[p][:per]]


def tensor_parallel_config(config: EngineConfig) -> EngineConfig:
    """The settings for tensor parallelism: a prompt step is one executable (not the single-device head and tail),
    and compiled steps are not saved whole (the executable cache holds single-device executables; JAX's own
    compilation cache still keeps them) where the user left that to the machine; what it cannot run is one clear
    error."""
    if config.tensor_parallel_size == 1:
        return config
    t = config.tuning
    if config.speculative and config.speculative != "ngram":
        raise TensorParallelError("tensor parallelism supports n-gram speculation only (not draft or DFlash models)")
    return dataclasses.replace(config, tuning=dataclasses.replace(
        t, prompt_step_head_layers=0,
        executable_cache=False if t.executable_cache is None else t.executable_cache))
