"""A request's output text as tokens arrive: incremental detokenizing and stop strings.

Torch-free, so the engine (which must stop generating at a stop string) and the router (which
streams the text) run the very same code and agree on every character.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.tokenizer import IncrementalDetokenizer, Tokenizer


class TextState:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                  skip_special_tokens=skip_special_tokens)
        self.stop = tuple(stop)
        self.text = ""
        self.stop_reason: str | None = None

    def add(self, token_id: int) -> str | None:
        """Append a token's text; returns the stop string that matched (the text is cut there)."""
        delta = self.detokenizer.add(token_id)
        if not self.stop or not delta:
            self.text += delta
            return None
        # A stop string can straddle the previous text and this delta: search only the tail.
        search_from = max(0, len(self.text) - max(len(s) for s in self.stop) + 1)
        self.text += delta
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        self.stop_reason = best[1]
        return best[1]

    def finish(self) -> None:
        """Take what the detokenizer still holds (bytes that never became a character)."""
        if self.stop_reason is None:  # after a stop string the text was cut there
            self.text += self.detokenizer.flush()

    @property
    def num_safe_chars(self) -> int:
        """How much of the text a stream may emit now: a tail that could still become the start
        of a stop string is held back until the next token settles it."""
        if self.stop_reason is not None or not self.stop:
            return len(self.text)
        return max(0, len(self.text) - (max(len(s) for s in self.stop) - 1))
