"""The op interface. `get_ops(name)` returns a module of ops with the signatures of ops.reference."""

from types import ModuleType


def get_ops(name: str = "reference") -> ModuleType:
    if name == "reference":
        from jaxinfer.ops import reference

        return reference
    raise ValueError(f"unknown ops backend {name!r} (reference)")
