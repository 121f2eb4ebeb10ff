"""Sampling parameters: the per-request knobs that travel from the API to the sampler.

A frozen dataclass validated on construction, so an invalid value is rejected with a message
that names the field before the request reaches any engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from services.common.errors import InvalidRequestError


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "structural_tag")
INT32_MAX = 2**31 - 1
"""The wire's (proto/common.proto) int32 fields: top_k, max_tokens, min_tokens, stop_token_ids."""
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
"""The wire's seed."""
MAX_LOGIT_BIAS = 100.0
"""A logit bias is in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range: -100 bans a token, 100
makes it all but certain)."""


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. ``spec`` by kind:

    * ``json_schema``: a JSON Schema, as JSON text;
    * ``json_object``: any JSON object (``spec`` is empty);
    * ``regex``: a regular expression the whole output matches;
    * ``grammar``: an EBNF grammar (the GBNF dialect of llama.cpp / xgrammar, root rule ``root``);
    * ``structural_tag``: JSON text ``{"triggers": [...], "tags": [{"begin", "schema", "end"}]}``:
      free text, except that after a trigger the output must be one of the tags, whose body
      matches its JSON schema (tool calls with ``tool_choice: auto``).
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"structured output kind {self.kind!r} is invalid: use one of "
                                      f"{list(STRUCTURED_KINDS)}")
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(f"structured output of kind {self.kind!r} needs a spec")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 (or -1) disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's probability."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of every token already generated."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens seen in prompt or output."""
    max_tokens: int = 16
    """Most tokens to generate."""
    min_tokens: int = 0
    """EOS and stop token ids are ignored until this many tokens exist."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    stop: tuple[str, ...] = ()
    """Stop strings; the output is cut before the first one found."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (the token is kept in token_ids, not in text)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives per step."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the returned text."""
    structured: StructuredOutput | None = None
    """Constrain the output to a grammar: decode masks every token the grammar does not allow."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, sorted by id: the bias is added to the token's logit after the
    grammar mask, before penalties and sampling (a mapping is accepted and sorted)."""
    num_speculative_tokens: int | None = None
    """Most draft tokens a step verifies for this request where the engine drafts (its
    ``speculative_config``; the name is that config's): 0 turns drafting off for it; None: the
    engine's own number. Outputs are the same either way; only the speed differs."""

    def __post_init__(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias={self.logit_bias!r} is invalid: must map token ids "
                                      f"to numbers") from None
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name}={getattr(self, name)!r} is invalid: {why}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= INT32_MAX:
            raise bad("top_k", f"must be an integer in [0, {INT32_MAX}] (0 or -1 disables)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 disables)")
        max_tokens = self.max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= INT32_MAX:
            raise bad("max_tokens", f"must be an integer in [1, {INT32_MAX}]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not INT64_MIN <= self.seed <= INT64_MAX):
            raise bad("seed", f"must be an integer in [{INT64_MIN}, {INT64_MAX}] or None")
        if self.num_speculative_tokens is not None and (
                not isinstance(self.num_speculative_tokens, int) or isinstance(self.num_speculative_tokens, bool)
                or not 0 <= self.num_speculative_tokens <= INT32_MAX):
            raise bad("num_speculative_tokens", f"must be an integer in [0, {INT32_MAX}] or None")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in [0, 20] or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"token ids must be integers in [0, {INT32_MAX}]")
        if any(not 0 <= t <= INT32_MAX for t, _ in self.logit_bias):
            raise bad("logit_bias", f"token ids must be integers in [0, {INT32_MAX}]")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):  # NaN fails too
            raise bad("logit_bias", f"biases must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise bad("logit_bias", "names a token id twice")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's logprob (of the raw logits, before any sampling transform)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """The params.logprobs most likely (token_id, logprob) pairs, most likely first."""
