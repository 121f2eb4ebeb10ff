"""Compiling structured-output grammars against the engine's tokenizer, with an LRU cache.

A request's :class:`StructuredOutput` becomes a :class:`CompiledGrammar` before it joins the
engine: the async engine awaits :meth:`GrammarCompiler.compile` in a worker thread (the step
loop keeps running other requests meanwhile), the offline path calls it directly. Each request
then gets its own matcher, a cheap copy of the compiled one (``new_matcher``), which the model
runner keeps (``services/engine/grammar.py``).

The tokenizer is fixed per engine, so it belongs to the compiler and the cache key is only
``(kind, spec)``; a hit costs a dict lookup. Building llguidance's tokenizer (its token trie,
about 0.6 s for a 49k vocabulary) waits for the first grammar, so engines that never see one
never pay for it. Thread-safe: compiles may run in several worker threads at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance

from services.common.errors import InvalidRequestError
from services.common.sampling_params import StructuredOutput
from services.common.structured import check_structured, to_grammar
from services.common.tokenizer import Tokenizer

GrammarKey = tuple[str, str]


class CompiledGrammar:
    """One grammar compiled for one tokenizer; immutable once built."""

    def __init__(self, key: GrammarKey, template: llguidance.LLMatcher) -> None:
        self.key = key
        self._template = template
        """A matcher that never consumes a token: every request's matcher is a copy of it (the
        copies share its lazily built lexer, so later requests start warm)."""

    def new_matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()

    def check_prefix(self, token_ids: Sequence[int]) -> None:
        """InvalidRequestError unless an output may start with ``token_ids`` (those another
        engine already generated for a request this one continues)."""
        matcher = self.new_matcher()
        if token_ids and not matcher.consume_tokens(list(token_ids)):
            raise InvalidRequestError(f"structured output {self.key[0]}: the output tokens already generated do "
                                      f"not match the grammar ({matcher.get_error().splitlines()[0]})")


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 256) -> None:
        """``vocab_size``: the width of the model's logits (it may exceed the tokenizer's
        vocabulary when the embedding is padded); masks are this wide."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self.num_hits = 0
        self.num_misses = 0
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, CompiledGrammar] = OrderedDict()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        decoder = tokenizer.backend.get_added_tokens_decoder()
        self._special_tokens = frozenset(t.content for t in decoder.values() if t.special)

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                if self.tokenizer.vocab_size > self.vocab_size:
                    raise InvalidRequestError(
                        f"structured output needs the tokenizer's {self.tokenizer.vocab_size} tokens to fit "
                        f"the model's {self.vocab_size} logits")
                self._lltokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids))
            return self._lltokenizer

    def warm_up(self) -> None:
        """Builds llguidance's view of the tokenizer now (0.6-0.8 s for a 49K vocabulary), so
        the first constrained request does not wait for it; a tokenizer that cannot constrain
        says so at that request instead."""
        try:
            self.lltokenizer
        except InvalidRequestError:
            pass

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar (cached), or InvalidRequestError naming what is wrong with it."""
        key = (structured.kind, structured.spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return compiled
        check_structured(structured)  # the same messages the router gives
        template = llguidance.LLMatcher(self.lltokenizer, to_grammar(structured, self._special_tokens),
                                        log_level=0)
        if template.is_error():
            raise InvalidRequestError(f"structured output {structured.kind}: {template.get_error()}")
        with self._lock:
            self.num_misses += 1
            # Two threads may have compiled the same grammar at once: keep the first.
            compiled = self._cache.setdefault(key, CompiledGrammar(key, template))
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled
