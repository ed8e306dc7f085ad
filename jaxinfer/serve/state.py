"""What the routes share: the model's description, the engine driver, metrics, token texts."""

from __future__ import annotations

import dataclasses

from jaxinfer.serve.async_engine import AsyncEngine
from jaxinfer.serve.logprobs import TokenText
from jaxinfer.serve.metrics import Metrics
from jaxinfer.serve.params import ModelInfo


@dataclasses.dataclass
class ServerState:
    info: ModelInfo
    engine: AsyncEngine
    metrics: Metrics
    token_text: TokenText
    created: int
