"""Compiled steps saved whole on disk, so that a warm start skips tracing and lowering.

JAX's persistent compilation cache is keyed by the lowered module: every start must still trace and
lower each step before it can look the executable up, and the Pallas kernels' Triton lowering is most of
a warm start's time then. This cache is keyed by
what the module is made from instead: the engine's own source, the versions of jax and jaxlib, the
device and its runtime, the XLA flags, the kernels' measured tables, the step's name and settings, and
the tree, shapes and dtypes of its arguments. It holds the executable serialized by `jax.experimental.serialize_executable`.

A file that fails to load (truncated, written by another build) is a miss: it is removed and the
step compiled again. Every code change makes new keys, so the folder is kept under `max_bytes`: after a
save, the least recently used files (loading one touches it) go first. Only load files this process's
user wrote: unpickling runs code.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable

import jaxinfer


@functools.cache
def _source_digest() -> str:
    """Digest of every Python file of the jaxinfer package (a code change is a new key)."""
    h = hashlib.sha256()
    root = Path(jaxinfer.__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _kernel_choices() -> str:
    """The kernels' measured tables (every upper-case name of pallas/tables.py), which a step reads when it is
    traced: a bench option or a test that changes one at run time makes new keys, as a code change does."""
    from jaxinfer.pallas import tables

    return repr([(name, sorted(value.items()) if isinstance(value, dict) else value)
                 for name, value in sorted(vars(tables).items()) if name.isupper()])


def _environment() -> str:
    import jaxlib

    device = jax.devices()[0]
    return repr((jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
                 device.client.platform_version, os.environ.get("XLA_FLAGS", ""),
                 jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision))


def _signature(args: Any) -> str:
    """The argument tree with each leaf's shape and dtype (and weak type, which changes the program)."""
    def leaf(x):
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)))
        return (type(x).__name__, repr(x))
    leaves, tree = jax.tree.flatten(args)
    return repr((str(tree), [leaf(x) for x in leaves]))


class ExecutableCache:
    """Serialized executables in `directory`, one file per key, at most `max_bytes` in all."""

    def __init__(self, directory: str | Path, max_bytes: int = 20 << 30):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.hits = self.misses = 0

    def key(self, name: str, settings: str, args: Any) -> str:
        h = hashlib.sha256()
        for part in (_source_digest(), _environment(), _kernel_choices(), name, settings, _signature(args)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:40]

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.exe"

    def load(self, key: str) -> jax.stages.Compiled | None:
        path = self._path(key)
        if not path.is_file():
            self.misses += 1
            return None
        try:
            blob, in_tree, out_tree = pickle.loads(path.read_bytes())
            # the engine runs on the default device: load for it alone (not every device of the host)
            compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree,
                                                                 execution_devices=jax.devices()[:1])
        except Exception as e:  # noqa: BLE001 -- any unreadable entry is a miss, never a failed start
            warnings.warn(f"executable cache: dropping unreadable {path.name} ({type(e).__name__}: {e})")
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        self.hits += 1
        os.utime(path)   # recently used
        return compiled

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Write atomically (a temporary file renamed into place); a failure only warns."""
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
            self._trim(keep=self._path(key))
        except Exception as e:  # noqa: BLE001 -- a cache that cannot be written costs the next start only
            warnings.warn(f"executable cache: could not save to {self.directory} ({type(e).__name__}: {e})")

    def _trim(self, keep: Path) -> None:
        """Remove the least recently used files until the folder fits in max_bytes (never `keep`)."""
        files = []
        for p in self.directory.glob("*.exe"):
            try:
                st = p.stat()
            except FileNotFoundError:   # another process trimmed it
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            if p != keep:
                p.unlink(missing_ok=True)
                total -= size
