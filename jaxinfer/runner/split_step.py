"""SplitStep: a one-sequence prompt step as two executables called back to back."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import jax

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kv_cache import KVCache
from jaxinfer.runner.batch import SamplerState
from jaxinfer.runner.steps import mixed_head, mixed_tail


class SplitStep:
    """A mixed step as two executables called back to back: mixed_head (the embedding and the first
    `head_layers` layers) and mixed_tail (the other layers and the sampling), each taking only its own
    layers' matrices. Called as a step is, (params, kv, state, batch). The device can start on the head's
    small graph while the host still launches the tail's (one graph of a whole prompt step starts only near
    the end of its launch)."""

    PARTS = ("head", "tail")

    def __init__(self, cfg: ModelConfig, ops: ModuleType, n_top: int, head_layers: int, greedy: bool,
                 attention: str, method: str, jit=jax.jit):
        self.cfg, self.head_layers = cfg, head_layers
        self.head = jit(functools.partial(mixed_head, cfg, ops, head_layers, attention), donate_argnums=(1,))
        tail = functools.partial(mixed_tail, cfg, ops, n_top, head_layers, greedy=greedy, attention=attention,
                                 method=method)
        self.tail = jit(tail, donate_argnums=(1, 2))
        self._split = (None, None, None)

    def split_params(self, params: dict) -> tuple[dict, dict]:
        """(the head's parameters, the tail's): each without the other's layer matrices (None in their
        place) or arrays it does not read (computed once per parameter tree)."""
        if self._split[0] is not params:
            k, layers = self.head_layers, params["layers"]
            head, tail = dict(params), dict(params)
            if isinstance(layers, (list, tuple)):   # split layers: each part its own matrices
                head["layers"] = [lp if i < k else None for i, lp in enumerate(layers)]
                tail["layers"] = [None if i < k else lp for i, lp in enumerate(layers)]
            for name in ("final_norm", "lm_head"):
                head.pop(name, None)
            if not self.cfg.tie_embeddings:
                tail.pop("embed", None)
            tail.pop("pos_embed", None)
            self._split = (params, head, tail)
        return self._split[1], self._split[2]

    def parts(self, params: dict, kv: KVCache, state: SamplerState, batch) -> list[tuple[str, Any, tuple]]:
        """(part name, jitted function, its arguments) of each part, for compiling them apart."""
        head, tail = self.split_params(params)
        # the head's trace, not jax.eval_shape: a step with compiler options (runner/compiler_options.RowsJit) may
        # only be traced at the top level
        x = self.head.trace(head, kv, state, batch).out_info[1]
        return [(self.PARTS[0], self.head, (head, kv, state, batch)),
                (self.PARTS[1], self.tail, (tail, kv, state, batch, x))]

    def __call__(self, params: dict, kv: KVCache, state: SamplerState, batch, head=None, tail=None):
        """head, tail: the parts' compiled executables (default: the jitted functions)."""
        head_params, tail_params = self.split_params(params)
        kv, x = (head or self.head)(head_params, kv, state, batch)
        return (tail or self.tail)(tail_params, kv, state, batch, x)

