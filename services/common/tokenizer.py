"""Text <-> token ids for the engine: a thin wrapper over a ``tokenizers.Tokenizer`` (tokenizer.json).

A model directory's tokenizer settings are read by :func:`read_tokenizer_config`, the one reader
the engine's loader and the instances' ModelInfo (which the router builds its tokenizer from) share.

Chat templates are rendered the way transformers renders them (sandboxed jinja2, ``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``tojson``), so a prompt built here is byte-identical to
``AutoTokenizer.apply_chat_template(..., tokenize=False)``.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from services.common.errors import InvalidRequestError
from services.common.token_bound import TokenBound, byte_level_alphabet

_REPLACEMENT_CHAR = "\ufffd"
# The special-token variables transformers hands every chat template.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_MAX_UTF8_BYTES = 4
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback
_BOUND_LOCK = threading.Lock()
"""Held while a tokenizer builds its token bound (once, on first use)."""


def _token_content(token) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' override: jinja's own tojson escapes HTML characters and sorts keys.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def read_tokenizer_config(directory: str | os.PathLike) -> dict:
    """A model directory's ``tokenizer_config.json`` ({} without one), its ``chat_template`` taken
    from the file that holds it, first found of::

        chat_template.jinja    the template's text: where transformers >= 4.50 saves it (and then
                               leaves it out of tokenizer_config.json)
        chat_template.json     {"chat_template": ...}: where processors saved it before that
        tokenizer_config.json  its own "chat_template" (older checkpoints, GGUF conversions)
    """
    path = Path(directory)
    config = _read_json_object(path / "tokenizer_config.json")
    if (jinja := path / "chat_template.jinja").is_file():
        config["chat_template"] = jinja.read_text(encoding="utf-8")
    elif (processor := path / "chat_template.json").is_file():
        if (template := _read_json_object(processor).get("chat_template")) is not None:
            config["chat_template"] = template
    return config


def _read_json_object(path: Path) -> dict:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


class Tokenizer:
    """Encode, decode and chat-format for one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        tokenizer_config: dict | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.backend = backend
        self.config = dict(tokenizer_config or {})
        self.chat_template = self._pick_chat_template(self.config.get("chat_template"))
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        ids = list(eos_token_ids or ())
        if (eos_id := self._id_of(self.eos_token)) is not None:
            ids.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self._bound_state: tuple[TokenBound | None] | None = None

    @classmethod
    def from_file(cls, path: str | os.PathLike, tokenizer_config: dict | None = None, **kwargs) -> "Tokenizer":
        return cls(BackendTokenizer.from_file(os.fspath(path)), tokenizer_config, **kwargs)

    @staticmethod
    def _pick_chat_template(template) -> str | None:
        # Older tokenizer_config.json files hold a list of named templates.
        if isinstance(template, list):
            named = {entry["name"]: entry["template"] for entry in template}
            return named.get("default")
        return template

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> tuple[int, ...]:
        decoder = self.backend.get_added_tokens_decoder()
        return tuple(sorted(token_id for token_id, token in decoder.items() if token.special))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens spelled in it (``<|im_start|>``) become their ids.

        ``add_special_tokens`` adds what the tokenizer's post-processor adds (a BOS for some models);
        chat prompts already carry theirs, hence the default.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def _token_bound(self) -> TokenBound | None:
        # Built on first use (the router's), once: concurrent first requests wait for it.
        if self._bound_state is None:
            with _BOUND_LOCK:
                if self._bound_state is None:
                    self._bound_state = (TokenBound.of(self.backend),)
        return self._bound_state[0]

    def min_num_tokens(self, text: str, enough: int | None = None) -> int:
        """A lower bound on ``len(self.encode(text))`` that costs far less than encoding: a prompt
        that cannot fit is refused without tokenizing it (token_bound.py). 0 for a tokenizer whose
        pipeline allows no such bound. Once the bound reaches ``enough`` it is not refined."""
        bound = self._token_bound
        return 0 if bound is None else bound.min_tokens(text, enough)

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _byte_alphabet(self) -> dict[str, int] | None:
        return byte_level_alphabet() if type(self.backend.decoder).__name__ == "ByteLevel" else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token may hold part of a UTF-8 character), as OpenAI's
        logprobs report them; a special token is its own spelling."""
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self.all_special_ids:
            return token.encode()
        if (alphabet := self._byte_alphabet) is not None:
            return b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode() for c in token)
        if match := _BYTE_TOKEN.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        return token.replace("\u2581", " ").encode()

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        return compile_chat_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for ``messages``; a template's ``raise_exception`` becomes InvalidRequestError."""
        special = {name: _token_content(self.config[name]) for name in _SPECIAL_TOKEN_NAMES if name in self.config}
        variables = {**special, **kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            return self._compiled_template.render(**variables)
        except (jinja2.exceptions.TemplateError, TypeError) as exc:  # TypeError: e.g. content None + str
            raise InvalidRequestError(f"chat template: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, never splitting a UTF-8 character.

    The concatenated deltas equal ``tokenizer.decode(output_ids)`` (after :meth:`flush`). Each step
    decodes only a short window of recent tokens, so a step costs O(1), not O(output length):

        window ids   [ context tokens | new tokens ]        (older ids are dropped)
        window text  "already emitted"  "delta"  [U+FFFD held back]

    Decoding appended bytes only changes the unfinished end of the text, where a character split
    over tokens shows as U+FFFD (one for byte-level BPE, one per byte for sentencepiece byte
    fallback). So the text before a trailing U+FFFD run is final, and the run itself is held until
    the rest of the character arrives -- all but its last three, which no character can complete.
    """

    _CONTEXT_TOKENS = 4
    """Tokens kept before new ones: a window must not start right at a token whose decoded
    form depends on what precedes it (sentencepiece's leading space)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids or ())[-self._CONTEXT_TOKENS:]
        self._num_emitted_chars = len(self._final_part(self._decode_window()))

    def _decode_window(self) -> str:
        return self._tokenizer.decode(self._ids, self._skip_special_tokens)

    @staticmethod
    def _final_part(text: str) -> str:
        num_held = min(len(text) - len(text.rstrip(_REPLACEMENT_CHAR)), _MAX_UTF8_BYTES - 1)
        return text[: len(text) - num_held]

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ("" while a character is split)."""
        self._ids.append(token_id)
        text = self._decode_window()
        final = self._final_part(text)
        delta = final[self._num_emitted_chars:]
        self._num_emitted_chars = max(self._num_emitted_chars, len(final))
        if final == text and len(self._ids) > 2 * self._CONTEXT_TOKENS:
            # Nothing held: slide the window, counting its (already emitted) text as emitted.
            del self._ids[: -self._CONTEXT_TOKENS]
            self._num_emitted_chars = len(self._decode_window())
        return delta

    def flush(self) -> str:
        """Whatever is still held back: bytes at the very end that never became a character."""
        delta = self._decode_window()[self._num_emitted_chars:]
        self._num_emitted_chars += len(delta)
        return delta
