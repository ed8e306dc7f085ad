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


def shared_seed() -> int:
    """A random seed that every process of the run agrees on (process 0's, broadcast): requests that bring no
    seed of their own must draw the same keys on every host, which run the same steps."""
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.int64(np.random.SeedSequence().entropy % (1 << 62))
    return int(multihost_utils.broadcast_one_to_all(mine))


def least_of_all_processes(value: int) -> int:
    """The least of every process's `value` (itself with one process): a size every host must agree on, such as
    the KV pool's pages, which each sizes from its own device's free memory."""
    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(value))))


class CommandChannel:
    """Numbered messages from process 0 to the others through the key-value store of JAX's distributed runtime
    (its coordination service, which jax.distributed.initialize started): the followers of a multi-host server
    read the engine calls that process 0 makes (engine.followers). Old messages are deleted `KEEP` behind."""

    KEEP = 100_000
    PREFIX = "jaxinfer/command/"

    def __init__(self):
        from jax._src import distributed   # JAX's own client of its coordination service (no public handle)

        self._client = distributed.global_state.client
        if self._client is None:
            raise RuntimeError("a command channel needs jax.distributed.initialize first")
        self.sent = 0

    def send(self, message: bytes) -> None:
        self._client.key_value_set_bytes(f"{self.PREFIX}{self.sent}", message)
        if self.sent >= self.KEEP:
            self._client.key_value_delete(f"{self.PREFIX}{self.sent - self.KEEP}")
        self.sent += 1

    def receive(self, n: int, timeout_s: float = 60.0) -> bytes | None:
        """Message n, waiting up to timeout_s for it (None if it has not come by then)."""
        try:
            return self._client.blocking_key_value_get_bytes(f"{self.PREFIX}{n}", int(timeout_s * 1000))
        except Exception as e:   # the runtime's DEADLINE_EXCEEDED (its error type is not public)
            if "DEADLINE_EXCEEDED" in str(e):
                return None
            raise
