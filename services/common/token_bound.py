"""A cheap lower bound on a text's token count, so that a prompt that cannot fit the context is
refused before the tokenizer spends time and memory in proportion to it (STYLE rule 17).

Every token the model emits stands for a run of the bytes the model sees (the text after the
normalizer), and no two tokens share a byte. Weigh each byte b as 1 / L(b), where L(b) is the
length in bytes of the longest token that holds b. A token t covers len(t) bytes, each weighing at
most 1 / len(t), so it adds at most 1 to the sum of the weights::

    num_tokens >= sum over the text's bytes b of 1 / L(b)      (a byte that may be dropped weighs 0)

Cheaper still (no copy of the text), and tried first when the caller only asks whether a limit is
reached: no token holds more than K = max L(b) bytes and a character is at least one byte, so
``num_tokens >= num_characters / K`` (leaving out characters that may be dropped).

This holds where each byte ends up in a vocabulary token or is dropped, never fused into anything
else: byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen2) and SentencePiece-style BPE with byte fallback
(Llama 2), behind normalizers and pre-tokenizers that drop no text. Added tokens must not swallow
the whitespace around them (``lstrip`` / ``rstrip``). Any other tokenizer gets no bound (0), and its
prompts are tokenized in full.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "UnicodeScripts", "Split", "Punctuation"}
"""Pre-tokenizers that only split (or, Metaspace, replace spaces): no text is dropped, unless a
Split / Punctuation has behavior Removed."""
_CONTINUATION_BYTES = range(0x80, 0xC0)


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each byte as one printable character; this maps them back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


@dataclass(frozen=True)
class TokenBound:
    table: bytes
    """A ``bytes.translate`` table: byte value -> its weight class (an index into ``lengths``)."""
    lengths: tuple[int, ...]
    """Each class's L; class 0 (L = 0) weighs nothing."""
    max_token_bytes: int
    """K: the longest token's length in bytes."""
    dropped_chars: str | None
    """One-byte characters that no token may hold, left out of the quick bound, which counts the
    characters of the text as sent; None: that count is no bound here."""
    is_quick_ascii_only: bool
    """The quick bound holds for ASCII text only (NFC may shorten other text)."""
    normalize: Callable[[str], str] | None
    space_replacement: str | None
    """Metaspace's stand-in for " " (the model sees it instead)."""

    @classmethod
    def of(cls, backend: BackendTokenizer) -> TokenBound | None:
        """The bound for this tokenizer, or None where its pipeline does not guarantee one."""
        model = backend.model
        added = list(backend.get_added_tokens_decoder().values())
        normalizers = _flatten(_config(backend.normalizer), "normalizers")
        pre_tokenizers = _flatten(_config(backend.pre_tokenizer), "pretokenizers")
        vocab = backend.get_vocab(with_added_tokens=False)
        why_not = _unsupported(model, vocab, added, normalizers, pre_tokenizers)
        if why_not is not None:
            logger.warning("no cheap token bound for this tokenizer (%s): long prompts are tokenized in full",
                           why_not)
            return None
        is_byte_level = any(p["type"] == "ByteLevel" for p in pre_tokenizers)
        metaspace = next((p for p in pre_tokenizers if p["type"] == "Metaspace"), None)
        normalize = backend.normalizer.normalize_str if normalizers else None
        space_replacement = None if metaspace is None else metaspace.get("replacement", "\u2581")

        def seen(text: str) -> bytes:
            text = normalize(text) if normalize is not None else text
            return (text if space_replacement is None else text.replace(" ", space_replacement)).encode()

        longest = [0] * 256
        if is_byte_level:
            alphabet = byte_level_alphabet()
            # A byte whose character is no token by itself is dropped (or becomes unk), never merged.
            kept = {alphabet[c] for c in vocab if len(c) == 1 and c in alphabet}
            spellings = [bytes(alphabet[c] for c in token) for token in vocab
                         if all(c in alphabet for c in token)]
        else:  # byte fallback: every byte of a character outside the vocabulary is its own <0xNN> token
            kept = set(range(256))
            longest = [1] * 256
            spellings = [token.encode() for token in vocab]
        for token in added:
            spellings += [token.content.encode(), seen(token.content)]
        for spelling in spellings:
            for b in set(spelling):
                longest[b] = max(longest[b], len(spelling))
        lengths = (0, *sorted({longest[b] for b in kept if longest[b]}))
        table = bytes(lengths.index(longest[b]) if b in kept else 0 for b in range(256))
        dropped = {b for b in range(256) if table[b] == 0}
        dropped_chars = "".join(chr(b) for b in sorted(dropped) if b < 0x80)
        # Counting the characters as sent is a bound if none of them can turn into dropped ones:
        # every multi-byte character keeps a byte, and no replacement is made of dropped ones only.
        replacements = [n["content"] for n in normalizers if n["type"] == "Replace"]
        replacements += [space_replacement] if space_replacement is not None else []
        if dropped & set(_CONTINUATION_BYTES) or any(all(c in dropped_chars for c in r) for r in replacements):
            dropped_chars = None
        is_quick_ascii_only = any(n["type"] == "NFC" for n in normalizers)
        return cls(table, lengths, max(lengths), dropped_chars, is_quick_ascii_only, normalize, space_replacement)

    def min_tokens(self, text: str, enough: int | None = None) -> int:
        """A lower bound on the token count of ``text`` (no special tokens added). If the quick
        bound reaches ``enough``, it is returned as it is: the caller needs to know no more."""
        if not text:
            return 0
        is_quick_valid = self.dropped_chars is not None and (not self.is_quick_ascii_only or text.isascii())
        if enough is not None and is_quick_valid and -(-len(text) // self.max_token_bytes) >= enough:
            num_chars = len(text) - sum(text.count(c) for c in self.dropped_chars)
            quick = -(-num_chars // self.max_token_bytes)
            if quick >= enough:
                return quick
        if self.normalize is not None:
            text = self.normalize(text)
        if self.space_replacement is not None:
            text = text.replace(" ", self.space_replacement)
        classes = text.encode("utf-8", "surrogatepass").translate(self.table)
        total = sum(Fraction(classes.count(i), length) for i, length in enumerate(self.lengths) if length)
        return -(-total.numerator // total.denominator)


def _flatten(component: dict | None, key: str) -> list[dict]:
    """A normalizer / pre-tokenizer as its list of steps (a Sequence's members, in order)."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [step for member in component.get(key) or () for step in _flatten(member, key)]
    return [component]


def _config(component) -> dict | None:
    """A normalizer's / pre-tokenizer's settings, as tokenizer.json spells them."""
    return None if component is None else json.loads(component.__getstate__())


def _unsupported(model, vocab: dict[str, int], added: list, normalizers: list[dict],
                 pre_tokenizers: list[dict]) -> str | None:
    """Why the bound would not hold for this pipeline; None: it holds."""
    if type(model).__name__ != "BPE":
        return f"a {type(model).__name__} model"
    if model.continuing_subword_prefix or model.end_of_word_suffix:
        return "subword prefixes or suffixes"
    if any(token.lstrip or token.rstrip for token in added):
        return "added tokens that swallow whitespace"
    for step in normalizers:
        kind = step.get("type")
        pattern = (step.get("pattern") or {}).get("String") if kind == "Replace" else None
        if kind == "Replace" and (pattern is None or len(pattern) != 1 or not step.get("content")):
            return "a normalizer that replaces more than one character or by nothing"
        if kind not in ("NFC", "NFD", "Prepend", "Replace"):
            return f"the {kind} normalizer"
    for step in pre_tokenizers:
        kind = step.get("type")
        if kind not in _KEEPING_PRE_TOKENIZERS or step.get("behavior") in ("Removed", "removed"):
            return f"the {kind} pre-tokenizer (may drop text)"
    is_byte_level = any(p["type"] == "ByteLevel" for p in pre_tokenizers)
    if not is_byte_level and (not model.byte_fallback or any(f"<0x{b:02X}>" not in vocab for b in range(256))):
        return "no byte-level alphabet and no complete byte fallback"
    return None
