"""Several hosts, one model: `jax.distributed`, one process per host (XLA's collectives between them: NCCL on GPUs,
gloo on CPUs). After `initialize`, `jax.devices()` lists every process's devices and one tensor-parallel mesh
(runner.mesh) spans them; each process runs the same compiled steps on its own devices' shards, and XLA's
collectives carry the all-reduces between hosts.
"""

from __future__ import annotations

import jax


def parse(spec: str) -> tuple[str, int, int]:
    """"HOST:PORT,NUM_PROCESSES,PROCESS_ID" -> its parts, or one clear error."""
    parts = spec.split(",")
    try:
        address, num_processes, process_id = parts[0], int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        raise ValueError(f"distributed must be HOST:PORT,NUM_PROCESSES,PROCESS_ID, got {spec!r}") from None
    if len(parts) != 3 or ":" not in address or not 0 <= process_id < num_processes:
        raise ValueError(f"distributed must be HOST:PORT,NUM_PROCESSES,PROCESS_ID with 0 <= PROCESS_ID < "
                         f"NUM_PROCESSES, got {spec!r}")
    return address, num_processes, process_id


def initialize(spec: str) -> None:
    """Join the run that `spec` ("HOST:PORT,NUM_PROCESSES,PROCESS_ID"; process 0 is the coordinator, at
    HOST:PORT) describes, once per process and before anything starts JAX's backends; a second call with the
    same spec is a no-op."""
    address, num_processes, process_id = parse(spec)
    if jax.distributed.is_initialized():
        if jax.process_count() != num_processes or jax.process_index() != process_id:
            raise ValueError(f"this process already joined a run as {jax.process_index()} of {jax.process_count()}")
        return
    jax.distributed.initialize(coordinator_address=address, num_processes=num_processes, process_id=process_id)
