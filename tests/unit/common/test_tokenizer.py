"""The tokenizer built from GGUF metadata, checked against transformers' GGUF tokenizer, and the
incremental detokenizer checked against whole-sequence decode."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from services.common.errors import InvalidRequestError
from services.engine.models.gguf_file import GGUFFile, build_byte_level_bpe
from services.engine.models.loader import default_gguf_path
from services.common.tokenizer import IncrementalDetokenizer, Tokenizer, read_tokenizer_config

STRINGS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is about 3.14159.",
    "  leading and trailing spaces  ",
    "multiple   internal    spaces\tand\t\ttabs",
    "line one\nline two\r\n\n\nline five\n",
    "I'm sure they'll say it's fine, don't you think? We've seen it. I'D SAY",
    "Café naïve résumé façade Ångström",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ ー",
    "Emoji: 😀👍🏽🇺🇸 and ❤️ family 👨‍👩‍👧",
    "Numbers 12345 and 1,000,000 and 0x1F and 3e-8",
    "def foo(x):\n    return x ** 2  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "<repo_name>epd<file_sep>main.py",
    "Россия и Україна, مرحبا بالعالم, שלום",
    "zero\u200bwidth and nbsp\u00a0here",
    "URL: https://example.com/path?q=1&r=2#frag",
    "",
    "      ",
    "ABC123def456",
]

# SmolLM2's tokenizer.json on the Hub (StarCoder style); a GGUF only says "smollm".
SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    gguf_file = GGUFFile(default_gguf_path())
    backend, tokenizer_config = gguf_file.tokenizer()
    return Tokenizer(backend, tokenizer_config, eos_token_ids=gguf_file.model_config("x").eos_token_ids)


@pytest.fixture(scope="module")
def transformers_smollm2():
    from transformers import AutoTokenizer

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_encode_matches_transformers(smollm2, transformers_smollm2):
    for text in STRINGS:
        assert smollm2.encode(text) == transformers_smollm2.encode(text, add_special_tokens=False), text


def test_numeric_symbols_are_isolated_like_smollm2s_tokenizer_json(smollm2, transformers_smollm2):
    """HF's Digits (and llama.cpp's "smollm" \\p{N} split) isolate every numeric character, "²" too.

    transformers' GGUF tokenizer has no "smollm" entry and skips that split, so it is no oracle for
    numeric symbols next to a space: for these it encodes differently.
    """
    cases = {"a ² b": ["a ", "²", " b"], "x² + ½ = ①": ["x", "²", " + ", "½", " = ", "①"]}
    for text, pieces in cases.items():
        assert smollm2.encode(text) == [i for piece in pieces for i in smollm2.encode(piece)]
        assert smollm2.encode(text) != transformers_smollm2.encode(text, add_special_tokens=False)


def test_pre_tokenizer_is_smollm2s(smollm2):
    saved = json.loads(smollm2.backend.to_str())
    assert saved["pre_tokenizer"] == SMOLLM2_PRE_TOKENIZER
    assert saved["normalizer"] is None and saved["decoder"]["type"] == "ByteLevel"


def test_special_tokens(smollm2):
    assert (smollm2.bos_token, smollm2.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (smollm2.bos_token_id, smollm2.eos_token_ids) == (1, (2,))
    assert smollm2.all_special_ids == tuple(range(17))  # <|endoftext|> ... <empty_output>
    assert smollm2.vocab_size == 49152
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert ids[0] == 1 and ids[-2:] == [2, 0]
    assert smollm2.encode("hi", add_special_tokens=True) == smollm2.encode("hi")  # SmolLM2 adds no BOS


def test_decode(smollm2):
    for text in STRINGS:
        ids = smollm2.encode(text)
        assert smollm2.decode(ids, skip_special_tokens=False) == text
    ids = smollm2.encode("<|im_start|>assistant\nSure!<|im_end|>")
    assert smollm2.decode(ids) == "assistant\nSure!"


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Und auf Deutsch? 😀"}],
    [{"role": "user", "content": "  spaces\n\nand newlines  "}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smollm2, transformers_smollm2, add_generation_prompt):
    for messages in CONVERSATIONS:
        ours = smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        theirs = transformers_smollm2.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours == theirs


def test_chat_template_helpers_and_errors():
    from transformers import PreTrainedTokenizerFast

    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
        "{% endif %}{{ bos_token }}\n  {% for m in messages %}\n{{ m | tojson }}{% endfor %}{{ eos_token }}"
    )
    tokenizer = Tokenizer(tiny_backend(), {"chat_template": template, "bos_token": "<s>",
                                           "eos_token": {"content": "</s>", "special": True}})
    messages = [{"role": "user", "content": "é <b>"}]
    # lstrip_blocks eats the indent before {% for %}, trim_blocks the newline after it; tojson
    # leaves non-ASCII and HTML alone.
    assert tokenizer.apply_chat_template(messages) == '<s>\n{"role": "user", "content": "é <b>"}</s>'
    reference = PreTrainedTokenizerFast(tokenizer_object=tiny_backend(), bos_token="<s>", eos_token="</s>",
                                        chat_template=template)
    assert tokenizer.apply_chat_template(messages) == reference.apply_chat_template(messages, tokenize=False)
    with pytest.raises(InvalidRequestError, match="first message must be from the user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="chat template"):
        Tokenizer(tiny_backend(), {"chat_template": "{{ messages[0]['content'] + '!' }}"}).apply_chat_template(
            [{"role": "user", "content": None}])
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer(tiny_backend()).apply_chat_template([{"role": "user", "content": "hi"}])


# --- a tiny vocabulary, to pin what the SmolLM2 vocabulary cannot show -------------------------------

def gpt2_byte_chars() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


TINY_MERGES = ["Ġ t", "h e", "Ġt he", "1 2", "Ġ 1", "Ġ a", "' s"]
TINY_TOKENS = ["<|endoftext|>", "<think>"] + gpt2_byte_chars() + [m.replace(" ", "") for m in TINY_MERGES]
TINY_TYPES = [3, 4] + [1] * (len(TINY_TOKENS) - 2)


def tiny_backend(pre: str = "smollm"):
    return build_byte_level_bpe(TINY_TOKENS, TINY_TYPES, TINY_MERGES, pre)


def test_tiny_vocabulary_pre_tokenizers():
    smollm, qwen2, gpt2 = (Tokenizer(tiny_backend(pre)) for pre in ("smollm", "qwen2", "gpt-2"))
    token = {t: i for i, t in enumerate(TINY_TOKENS)}
    # smollm and qwen2 isolate each digit, so the "1 2" and "Ġ 1" merges never apply.
    for tokenizer in (smollm, qwen2):
        assert tokenizer.encode("x12") == [token["x"], token["1"], token["2"]]
        assert tokenizer.encode("a 1") == [token["a"], token["Ġ"], token["1"]]
    assert gpt2.encode("x12") == [token["x"], token["12"]]
    assert gpt2.encode("a 1") == [token["a"], token["Ġ1"]]
    # User-defined tokens are matched whole but are text: decode keeps them.
    ids = smollm.encode("<think>the<|endoftext|>")
    assert ids == [token["<think>"], token["t"], token["he"], token["<|endoftext|>"]]
    assert smollm.decode(ids) == "<think>the" and smollm.all_special_ids == (0,)


def test_qwen2_pre_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    writer = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types(TINY_TYPES)
    writer.add_token_merges(TINY_MERGES)
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    ours = Tokenizer(tiny_backend("qwen2"))
    for text in STRINGS + ["x 12 the 123's", "it's 1 2 12"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text


def test_from_file_roundtrip(tmp_path):
    tiny_backend().save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}"}],
              "eos_token": {"content": "<|endoftext|>"}}
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json", config, eos_token_ids=[5])
    assert tokenizer.eos_token_ids == (5, 0) and tokenizer.bos_token_id is None
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    assert tokenizer.decode(tokenizer.encode("the 12")) == "the 12"


# --- where a model directory keeps its chat template ---------------------------------------------

CONFIG = {"eos_token": "</s>"}
TEMPLATE_FILES = {
    "tokenizer_config.json": json.dumps({**CONFIG, "chat_template": "from tokenizer_config.json"}),
    "chat_template.json": json.dumps({"chat_template": "from chat_template.json"}),
    "chat_template.jinja": "from chat_template.jinja",
}


@pytest.mark.parametrize("names, expected", [
    ((), {}),
    (("tokenizer_config.json",), {**CONFIG, "chat_template": "from tokenizer_config.json"}),
    (("chat_template.json",), {"chat_template": "from chat_template.json"}),
    (("chat_template.jinja",), {"chat_template": "from chat_template.jinja"}),
    (("tokenizer_config.json", "chat_template.json"), {**CONFIG, "chat_template": "from chat_template.json"}),
    (("tokenizer_config.json", "chat_template.jinja"), {**CONFIG, "chat_template": "from chat_template.jinja"}),
    (("chat_template.json", "chat_template.jinja"), {"chat_template": "from chat_template.jinja"}),
    (tuple(TEMPLATE_FILES), {**CONFIG, "chat_template": "from chat_template.jinja"}),
])
def test_the_chat_template_comes_from_the_first_file_that_holds_it(tmp_path, names, expected):
    """chat_template.jinja, else chat_template.json, else tokenizer_config.json's own; the rest of
    tokenizer_config.json is kept."""
    for name in names:
        (tmp_path / name).write_text(TEMPLATE_FILES[name])
    assert read_tokenizer_config(tmp_path) == expected


def test_a_chat_template_json_without_a_template_keeps_the_configs_own(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(TEMPLATE_FILES["tokenizer_config.json"])
    (tmp_path / "chat_template.json").write_text("{}")
    assert read_tokenizer_config(tmp_path)["chat_template"] == "from tokenizer_config.json"


# --- incremental detokenization -----------------------------------------------------------------

def stream(tokenizer, ids, **kwargs) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, **kwargs)
    return [detokenizer.add(token_id) for token_id in ids] + [detokenizer.flush()]


def test_deltas_concatenate_to_decode(smollm2):
    held_back = 0
    for text in STRINGS + ["€uro 😀😀😀 " * 5, "ﬁ ǅ ẞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀"]:
        ids = smollm2.encode(text)
        deltas = stream(smollm2, ids)
        assert "".join(deltas) == smollm2.decode(ids), text
        assert deltas[-1] == "" and not any("\ufffd" in delta for delta in deltas), text
        held_back += deltas.count("")
    assert held_back > 0  # some characters really were split over tokens


def test_deltas_with_prompt_and_special_tokens(smollm2):
    prompt = smollm2.encode("<|im_start|>user\nÇa va?<|im_end|>\n<|im_start|>assistant\n")
    output = smollm2.encode("Très bien 👍🏽!<|im_end|>")
    assert "".join(stream(smollm2, output, prompt_token_ids=prompt)) == "Très bien 👍🏽!"
    kept = stream(smollm2, output, prompt_token_ids=prompt, skip_special_tokens=False)
    assert "".join(kept) == "Très bien 👍🏽!<|im_end|>"


def test_broken_bytes_are_held_then_released(smollm2):
    byte_id = {b: smollm2.backend.token_to_id(c) for b, c in enumerate(gpt2_byte_chars())}
    ids = [byte_id[0xF0], byte_id[ord("a")], byte_id[0xF0], byte_id[0x9F], byte_id[0x98]]
    deltas = stream(smollm2, ids)
    assert deltas == ["", "\ufffda", "", "", "", "\ufffd"]  # the last 3 bytes never become a character
    assert "".join(deltas) == smollm2.decode(ids)
    runaway = [byte_id[0x80]] * 12 + [byte_id[0xE2], byte_id[0x82], byte_id[0xAC]]  # lone continuations
    deltas = stream(smollm2, runaway)
    assert "".join(deltas) == smollm2.decode(runaway) == "\ufffd" * 12 + "€"
    assert deltas[-1] == "" and deltas[8] != ""  # invalid bytes are not held forever


@pytest.mark.parametrize("seed", range(4))
def test_random_token_streams(smollm2, seed):
    ids = np.random.default_rng(seed).integers(0, smollm2.vocab_size, 400).tolist()
    assert "".join(stream(smollm2, ids)) == smollm2.decode(ids)
    assert "".join(stream(smollm2, ids, skip_special_tokens=False)) == smollm2.decode(ids, False)
