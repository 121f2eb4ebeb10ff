"""Speculative decoding: draft tokens proposed cheaply, verified by one step of the model.

A decode step normally computes one token per sequence. With a drafter, the scheduler appends
up to k draft tokens to a decoding sequence's chunk; the runner computes logits at all 1 + k
positions in one forward and samples each position as a plain step would (same penalties,
bias, min_tokens suppression, with the drafts before it counted as output), then keeps tokens
while they equal the drafts::

    chunk      [ t_last  d1  d2  d3 ]        k = 3 drafts
    sampled    [ s0      s1  s2  s3 ]        s_j: the token a plain step would pick after d1..d_j
    kept       s0 (= d1?) s1 (= d2?) ...      up to and including the first s_j != d_{j+1},
                                              or all four when every draft matched (s3: a bonus)

Greedy output is therefore the plain output, bit for bit where the CPU's packed products run:
each drafted row is computed as a plain decode step would (the packed products, whose rows are
independent: every step by default, verify steps of up to 64 rows where prompts keep torch's;
and each token's attention as a single-token decode: attention.build_metadata's role rule).
A sampled output is exact in distribution: s_j is drawn from the model's distribution after the
kept prefix, which for a drafter that proposes one token with certainty is what rejection
sampling reduces to (accept d with probability p(d), else draw from p without d). Seeded rows
stay identical to plain decoding: position j draws the uniform a plain step would draw for that
output index, and the generator is rewound to just past the kept tokens (model_runner.py).

Drafters are small classes behind ``Drafter.propose`` (a draft model or an MTP head would be
another one, run by the runner before the verify step); today's is n-gram prompt lookup.
Torch-free: the scheduler runs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Protocol

from services.common.errors import InvalidRequestError

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` fields, where they exist."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    """Most draft tokens verified per step (k); each request's k adapts below it."""
    prompt_lookup_max: int = 4
    """Longest suffix n-gram looked up in the sequence."""
    prompt_lookup_min: int = 2
    """Shortest suffix n-gram looked up (shorter matches are too often wrong)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"speculative method {self.method!r}: must be one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise InvalidRequestError(
                f"speculative num_speculative_tokens={self.num_speculative_tokens}: must be 1 to 16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise InvalidRequestError(
                f"speculative prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max="
                f"{self.prompt_lookup_max}: need 1 <= min <= max <= 16")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """The config from its JSON (as ``--speculative-config`` takes it); None for ''."""
        if not text.strip():
            return None
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise InvalidRequestError(f"speculative config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise InvalidRequestError("speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequestError(f"speculative config: unknown field(s) {unknown}; known: {sorted(known)}")
        for name, value in raw.items():
            expected = str if name == "method" else int
            if not isinstance(value, expected) or isinstance(value, bool):
                raise InvalidRequestError(f"speculative config: {name}={value!r} must be {expected.__name__}")
        return cls(**raw)


class Drafter(Protocol):
    def propose(self, token_ids: list[int], state: DraftState, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens to follow ``token_ids`` (may be none)."""


class DraftState:
    """Per-sequence drafting state: the n-gram index and the adaptive draft length."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        self.length = DraftLength(config.num_speculative_tokens)


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (longest
    n first) and propose the tokens that followed it. Free to run, and right whenever the output
    copies from the prompt or itself (code edits, quoting, lists, repeated structure)."""

    def propose(self, token_ids: list[int], state: DraftState, max_tokens: int) -> list[int]:
        k = min(max_tokens, state.length.k)
        if k <= 0:
            return []
        start = state.index.match(token_ids)
        return [] if start is None else token_ids[start:start + k]


class NgramIndex:
    """For each n in [n_min, n_max], the n-grams of a sequence seen so far mapped to where the
    token after their latest occurrence sits, updated as tokens are appended::

        token_ids  ... a b c X ... a b c | (end)
                         ^^^^^ ^          ^^^^^ the suffix looked up
                               continuation: position of X, proposed first

    An n-gram enters the index only once a token follows it, so the suffix never finds itself.
    Building is O(length) once, then O(n_max) per appended token; a lookup is O(n_max).
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._next: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0
        """Positions p < _num_indexed have had the n-grams ending just before them indexed."""

    def match(self, token_ids: list[int]) -> int | None:
        """Where the continuation of the longest matching suffix starts, or None."""
        self._extend(token_ids)
        for n in range(min(self.n_max, len(token_ids)), self.n_min - 1, -1):
            at = self._next.get(tuple(token_ids[-n:]))
            if at is not None:
                return at
        return None

    def _extend(self, token_ids: list[int]) -> None:
        if len(token_ids) < self._num_indexed:  # the sequence was cut (a stop string): start again
            self._next.clear()
            self._num_indexed = 0
        for p in range(max(self._num_indexed, 1), len(token_ids)):
            # The n-grams ending at p - 1 now have a continuation: the token at p.
            for n in range(self.n_min, min(self.n_max, p) + 1):
                self._next[tuple(token_ids[p - n:p])] = p
        self._num_indexed = max(self._num_indexed, len(token_ids))


class DraftLength:
    """k for the next step, from how the last drafts fared.

    All of k accepted: the drafter is on a run, try one more (up to k_max). Some rejected: the
    run ended after ``accepted`` tokens; draft that many + 1 next time. None accepted ``patience``
    times in a row: stop drafting for ``cooldown`` steps (then try k = 1), so free text, where
    n-gram matches are mostly wrong, pays for few wasted positions.
    """

    patience = 2
    cooldown = 8

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.k = k_max
        self._num_misses = 0
        self._num_cooling = 0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            if self._num_cooling > 0:
                self._num_cooling -= 1
                if self._num_cooling == 0:
                    self.k = 1
            return
        if num_accepted == num_drafted:
            self.k, self._num_misses = min(self.k_max, num_drafted + 1), 0
            return
        self.k = max(1, num_accepted + 1)
        self._num_misses = self._num_misses + 1 if num_accepted == 0 else 0
        if self._num_misses >= self.patience:
            self.k, self._num_misses, self._num_cooling = 0, 0, self.cooldown


DRAFTERS: dict[str, type] = {"ngram": NgramDrafter}
"""method -> drafter class (a draft model or MTP head registers here)."""
