"""The cheap lower bound on a text's token count (services/common/token_bound.py): never above
the real count, for every tokenizer family it accepts, and 0 for those it does not."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from services.common.tokenizer import Tokenizer
from tests.unit.common.test_tokenizer import tiny_backend

PIECES = ["a", "the", "Paris", " ", "  ", "\n", "\n" + " " * 80, "\t", "#" * 80, "=" * 66, "-" * 64,
          "\x04", "\x06", "\x1d", "\x01", "\x7f", "é", "e\u0301", "\u212b", "ﬁ", "😀", "👨‍👩‍👧", "你好", "\u200b",
          "\U00040000", "<|im_start|>", "<|im_end|>", "<think>", "<|endoftext|>", "1234567", "'s", "Ġ", "ĊĠĠ",
          "▁", "<0x41>", "x12"]


def random_texts(num: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) * rng.randint(1, 6) for _ in range(rng.randint(0, 40))) for _ in range(num)]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> Tokenizer:
    path = Path(smollm2_dir)
    return Tokenizer.from_file(path / "tokenizer.json", json.loads((path / "tokenizer_config.json").read_text()))


def sentencepiece_backend(metaspace: bool) -> BackendTokenizer:
    """Llama 2's shape: BPE over characters, byte fallback, spaces as ▁ (by the normalizer or by a
    Metaspace pre-tokenizer)."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for token in ["▁", "t", "h", "e", "a", "P", "r", "i", "s", "é", "▁t", "he", "▁the", "▁▁", "▁▁▁▁", "ar", "is"]:
        vocab.setdefault(token, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "▁"), ("▁▁", "▁▁"), ("a", "r"), ("i", "s")]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
                                          unk_token="<0x00>"))
    if metaspace:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    else:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.add_special_tokens(["<s>", "</s>"])
    return backend


def assert_never_above(tokenizer: Tokenizer, texts: list[str]) -> float:
    """Checks the bound on every text; returns its best ratio to the real count."""
    best = 0.0
    for text in texts:
        num_tokens = len(tokenizer.encode(text))
        bound = tokenizer.min_num_tokens(text)
        assert bound <= num_tokens, (text, bound, num_tokens)
        assert tokenizer.min_num_tokens(text, enough=1) <= num_tokens
        if num_tokens:
            best = max(best, bound / num_tokens)
    return best


def test_never_above_the_real_count_for_smollm2(smollm2):
    bound = smollm2._token_bound
    # Six control characters are no token of SmolLM2's (BPE drops them): they weigh nothing.
    assert bound.max_token_bytes == 81 and bound.dropped_chars == "\x04\x06\x13\x14\x16\x1d"
    assert smollm2.encode("\x04" * 100) == [] and smollm2.min_num_tokens("\x04" * 100) == 0
    # Runs of '#' are 80-byte tokens: there the bound is exact.
    assert assert_never_above(smollm2, random_texts(1500)) == 1.0
    prose = "The capital of France is Paris. It is famous for the Eiffel Tower, café culture and art. " * 50
    assert 0 < smollm2.min_num_tokens(prose) <= len(smollm2.encode(prose))


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "gpt-2", "llama-bpe"])
def test_never_above_the_real_count_for_byte_level_families(pre):
    tokenizer = Tokenizer(tiny_backend(pre))
    assert tokenizer._token_bound is not None
    assert assert_never_above(tokenizer, random_texts(500, seed=1)) > 0.3


@pytest.mark.parametrize("metaspace", [False, True])
def test_never_above_the_real_count_for_sentencepiece_byte_fallback(metaspace):
    tokenizer = Tokenizer(sentencepiece_backend(metaspace))
    assert tokenizer._token_bound is not None
    texts = random_texts(500, seed=2) + ["<s> the Paris</s>", "    the", "ar is " * 20]
    assert assert_never_above(tokenizer, texts) > 0.3


@pytest.mark.parametrize("change", [
    lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Whitespace()),  # drops the spaces
    lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Split(Regex(" "), behavior="removed")),
    lambda b: setattr(b, "normalizer", normalizers.Strip()),
    lambda b: setattr(b, "normalizer", normalizers.Replace("ab", "")),
    lambda b: b.add_tokens([AddedToken("<mask>", lstrip=True)]),  # swallows the spaces before it
])
def test_no_bound_where_text_may_vanish(change):
    backend = tiny_backend("gpt-2")
    change(backend)
    tokenizer = Tokenizer(backend)
    assert tokenizer._token_bound is None and tokenizer.min_num_tokens("the " * 1000) == 0


def test_no_bound_for_other_models():
    wordpiece = BackendTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert Tokenizer(wordpiece).min_num_tokens("a" * 100) == 0


def test_a_huge_text_is_bounded_by_its_length(smollm2):
    """What a 10 MB chat body holds: the quick bound alone settles it, far above any context."""
    text = ("the quick brown fox jumps over the lazy dog and then some more ordinary words " * 130_000)[:10_000_000]
    assert smollm2.min_num_tokens(text, enough=8192) == -(-len(text) // 81)
    # Refined (no ``enough``), the per-byte weights give a bound ~3x tighter here.
    assert smollm2.min_num_tokens(text[:100_000]) > 3 * smollm2.min_num_tokens(text[:100_000], enough=1)
