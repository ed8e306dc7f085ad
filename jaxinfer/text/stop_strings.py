"""Stop strings: cutting streamed text at the first one, across deltas."""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    """Cuts streamed text at the first stop string (which is not emitted, as OpenAI and vLLM do).

    `feed(delta)` returns `(text_to_emit, stopped)`. Stop strings that span several deltas are
    found, and a tail that could still become a stop string is held back until it is resolved.
    `flush()` returns the held-back text at the end of the stream.
    """

    def __init__(self, stop: Iterable[str] | str | None) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._max_len = max((len(s) for s in self.stop_strings), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # which stop string ended the text

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stop_strings:
            return delta, False
        text = self._held + delta
        # Earliest match wins; at equal starts, either cut gives the same emitted text.
        best, best_stop = -1, None
        for s in self.stop_strings:
            i = text.find(s)
            if i != -1 and (best == -1 or i < best):
                best, best_stop = i, s
        if best_stop is not None:
            self.stopped, self.matched, self._held = True, best_stop, ""
            return text[:best], True
        hold = self._partial_suffix(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self._max_len - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return k
        return 0

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
