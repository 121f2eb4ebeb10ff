"""The prompt every protocol builds (openai_api, anthropic_api, responses_api): a chat's messages
through the tokenizer's chat template, with image parts as placeholder tokens and tool turns spelled
for templates that lack them, or a completions prompt as text or token ids; a prompt that cannot fit
the context is refused before it is tokenized (:func:`check_fits`)."""

from __future__ import annotations

import binascii
import re
import secrets
from dataclasses import dataclass

from services.common.errors import PromptTooLongError, invalid
from services.common.tokenizer import Tokenizer
from services.router.api.openai_models import ChatMessage
from services.router.api.tools import ToolPlan, render_call, render_result

_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "developer": "system", "tool": "tool"}
NO_IMAGES = "this model takes no images (no vision encoder serves it)"
"""The 400 for an image part sent to a text-only model, in every protocol (OpenAI's too is a 400)."""
_DATA_URI = re.compile(r"data:image/[\w.+-]+;base64,(?P<data>.*)", re.DOTALL)


def prompt_too_long(num_tokens: int, max_model_len: int, param: str,
                    is_lower_bound: bool = False) -> PromptTooLongError:
    at_least = "at least " if is_lower_bound else ""
    return invalid(f"the prompt is {at_least}{num_tokens} tokens, but this model's context is {max_model_len} "
                   f"tokens and at least one must be left for the output", param, "context_length_exceeded",
                   PromptTooLongError)


def check_fits(tokenizer: Tokenizer, texts: list[str], num_other_tokens: int, max_model_len: int | None,
               param: str) -> None:
    """Refuse texts that cannot fit the context before tokenizing them: their lower bound costs a
    pass over the text, while encoding costs ~1 s and ~150 MB per MB of text (STYLE rule 17)."""
    if max_model_len is None:
        return
    bound = num_other_tokens
    for text in texts:
        bound += tokenizer.min_num_tokens(text, enough=max_model_len - bound)
        if bound >= max_model_len:
            raise prompt_too_long(bound, max_model_len, param, is_lower_bound=True)


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    images: tuple[str, ...] = ()
    image_positions: tuple[int, ...] = ()


def check_image_uri(url: str, param: str) -> str:
    match = _DATA_URI.fullmatch(url)
    if match is None:
        raise invalid(f"{param}: only data:image/<format>;base64,... URIs are accepted (the router "
                      f"fetches URLs only under its --allow-image-urls prefixes); got {url[:40]!r}", param)
    try:
        binascii.a2b_base64(match.group("data"), strict_mode=True)
    except binascii.Error as exc:
        raise invalid(f"{param}: the image's base64 data does not decode ({exc})", param) from None
    return url


def _render_content(message: ChatMessage, where: str, image_token_id: int | None,
                    images: list[str], marker: str) -> str:
    """The message's content as one string, each image part replaced by ``marker``."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    pieces = []
    for i, part in enumerate(message.content):
        param = f"{where}.content[{i}]"
        if part.type == "text":
            if part.text is None:
                raise invalid(f"{param}: a text part needs \"text\"", param)
            pieces.append(part.text)
            continue
        if image_token_id is None:
            raise invalid(f"{param}: {NO_IMAGES}", param)
        if part.image_url is None:
            raise invalid(f"{param}: an image_url part needs \"image_url\": {{\"url\": ...}}", param)
        images.append(check_image_uri(part.image_url.url, f"{param}.image_url.url"))
        pieces.append(marker)
    return "\n".join(pieces)


def _render_tools(rendered: list[dict], messages: list[ChatMessage], tools: ToolPlan | None,
                  template_has_tools: bool) -> list[dict]:
    """Tool turns for a template that does not render tools itself: calls spelled in the assistant's
    text, results as user turns, the tools described in the system prompt."""
    if template_has_tools:
        return rendered
    out = []
    for turn, message in zip(rendered, messages):
        if message.role == "tool":
            turn = {"role": "user", "content": render_result(turn["content"])}
        elif message.tool_calls:
            calls = "".join(render_call(c.function.name, c.function.arguments) for c in message.tool_calls)
            turn = {**turn, "content": turn["content"] + calls}
        out.append(turn)
    if tools is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{tools.system_text()}"}
        else:
            out.insert(0, {"role": "system", "content": tools.system_text()})
    return out


def chat_prompt(messages: list[ChatMessage], tokenizer: Tokenizer, image_token_id: int | None,
                tools: ToolPlan | None = None, max_model_len: int | None = None, param: str = "messages") -> Prompt:
    """The templated conversation's token ids; with ``max_model_len``, a conversation that cannot
    fit is refused (``param`` names the field) before it is tokenized."""
    if not messages:
        raise invalid("messages must not be empty", "messages")
    # A fresh random marker per request, so no user text can pose as an image.
    marker = f"<|epd_image_{secrets.token_hex(8)}|>"
    images: list[str] = []
    rendered = []
    for i, message in enumerate(messages):
        if message.role not in _ROLES:
            raise invalid(f"messages[{i}].role {message.role!r} is not supported "
                          f"(use one of {sorted(_ROLES)})", f"messages[{i}].role")
        content = _render_content(message, f"messages[{i}]", image_token_id, images, marker)
        turn = {"role": _ROLES[message.role], "content": content}
        if message.tool_calls:
            turn["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        rendered.append(turn)
    template_has_tools = "tools" in (tokenizer.chat_template or "")
    rendered = _render_tools(rendered, messages, tools, template_has_tools)
    extra = {"tools": tools.template_tools()} if tools is not None and template_has_tools else {}
    pieces = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, **extra).split(marker)
    if len(pieces) != len(images) + 1:
        raise invalid(f"the chat template rendered {len(pieces) - 1} of the {len(images)} images", "messages")
    check_fits(tokenizer, pieces, len(images), max_model_len, param)
    token_ids: list[int] = []
    positions: list[int] = []
    for k, piece in enumerate(pieces):
        if k > 0:
            positions.append(len(token_ids))
            token_ids.append(image_token_id)
        token_ids.extend(tokenizer.encode(piece))
    if image_token_id is not None and token_ids.count(image_token_id) != len(images):
        raise invalid("the message text spells the image placeholder token; send images as "
                      "image_url parts", "messages")
    return Prompt(tuple(token_ids), tuple(images), tuple(positions))


def completion_prompt(prompt: str | list, tokenizer: Tokenizer, max_model_len: int | None = None) -> Prompt:
    """The prompt's token ids; with ``max_model_len``, one that cannot fit is refused before it is
    tokenized (or its ids scanned)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise invalid(f"{len(prompt)} prompts in one request are not supported yet: send one "
                          f"prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_fits(tokenizer, [prompt], 0, max_model_len, "prompt")
        token_ids = tokenizer.encode(prompt, add_special_tokens=True)
    else:
        if max_model_len is not None and len(prompt) >= max_model_len:
            raise prompt_too_long(len(prompt), max_model_len, "prompt")
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise invalid(f"prompt token ids {bad[:5]} are outside the vocabulary "
                          f"[0, {tokenizer.vocab_size})", "prompt")
        token_ids = list(prompt)
    if not token_ids:
        raise invalid("prompt must not be empty", "prompt")
    return Prompt(tuple(token_ids))
