"""Which `sample` method a step takes, chosen on the host from its rows' SamplingParams."""

from __future__ import annotations

from typing import Sequence

from jaxinfer.sampling.params import SamplingParams
from jaxinfer.sampling.sample import TOP_K_CANDIDATES

# Up to this many rows (padding included) the sort is cheaper than "filter-p" (the radix search for rows with
# top-p alone); "filter" (no search) is cheaper at every row count. bench/kernels_sampling.py measures both
# over a 152k vocabulary; 2 rows is interpolated, not measured.
SORT_MAX_ROWS = 2


def filter_pays(rows: int | None, method: str) -> bool:
    """Whether a step sampling `rows` rows (None: unknown) is worth the filter variant `method` over the sort."""
    return method == "filter" or rows is None or rows > SORT_MAX_ROWS


def sampler_for(params: Sequence[SamplingParams], rows: int | None = None) -> str:
    """The cheapest `sample` method that draws these rows' tokens without a device-side conditional:
    "plain" (no sampled row uses top-k or top-p); "filter" (every sampled row using top-k or top-p has a
    top-k of 1 to TOP_K_CANDIDATES, top-p with it or not) or "filter-p" (so do those with a top-k; others
    have top-p alone: the radix search, which pays only above SORT_MAX_ROWS rows); else "sort"."""
    sampled = [p for p in params if p.temperature > 0 and (p.top_k > 0 or p.top_p < 1)]
    if not sampled:
        return "plain"
    if any(p.top_k > TOP_K_CANDIDATES for p in sampled):
        return "sort"
    method = "filter" if all(p.top_k > 0 for p in sampled) else "filter-p"
    return method if filter_pays(rows, method) else "sort"
