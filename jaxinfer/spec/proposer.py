"""What the engine asks of a proposer and what a proposer reads of a sequence, as types (the proposers:
ngram.NgramProposer, draft_model.DraftModelProposer, dflash_proposer.DFlashProposer; engine.speculation picks one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class DraftedSequence(Protocol):
    """A generating sequence as a proposer sees it (the engine's scheduler.Sequence, or a chained verify step's view
    of one with the tokens it assumes appended)."""

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]

    @property
    def tokens(self) -> list[int]: ...


class Proposer(Protocol):
    """Drafts up to k tokens for each sequence ([] where it has none). Optional members the engine looks for:
    host_only (reads the host's tokens alone: asked while a step is in flight), needs_every_step (its state comes
    from the target's verify steps), capture_layers, page_bytes / attach (a KV pool of its own, indexed by the
    target's page tables), observe (the captured layer states), forget (a sequence left)."""

    name: str

    def propose(self, seqs: Sequence[DraftedSequence], k: int) -> list[list[int]]: ...
