"""The seam between the HTTP front door and whatever generates tokens.

The HTTP layer turns a client's request into one :class:`GenerateRequest` and consumes the
:class:`GenerateChunk` stream a :class:`Backend` yields for it. The real backend talks gRPC to the
encoder / prefill / decode instances; tests use a scripted double. Two rules hold both together:

* **Closing the iterator is the cancel signal.** When the client goes away, the HTTP layer calls
  ``aclose()`` on the iterator (or cancels the task awaiting it); the backend then cancels the
  request everywhere and releases what it holds. The HTTP layer also closes it once it has what it
  needs (a stop string it matched itself), so a backend must treat a close as "stop now".
* **Failures are exceptions.** A per-request failure is an ``EPDError`` subclass and is reported
  with its ``http_status``; any other exception is a bug or an outage (500, logged). A chunk with
  ``finish_reason="abort"`` means the backend gave up on a live client (503, as
  ``UnavailableError``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from services.common.sampling_params import SamplingParams, TokenLogprobs
from services.common.tokenizer import Tokenizer


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    """Unique per request; the same id the client sees (``chatcmpl-``, ``cmpl-``, ``msg_`` or ``resp_`` and hex)."""
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    """``max_tokens`` is always set explicitly and fits the context with the prompt."""
    images: tuple[str, ...] = ()
    """``data:image/...;base64,...`` URIs, in prompt order."""
    image_positions: tuple[int, ...] = ()
    """Index in ``prompt_token_ids`` of each image's single placeholder token (``image_token_id``);
    the encoder side expands each into the image's embeddings."""
    cache_salt: str = ""
    """Only requests with the same salt share cached KV."""
    request_class: str = "chat"
    """"agent" or "chat": how long the KV store keeps the request's blocks."""


@dataclass(frozen=True)
class GenerateChunk:
    token_ids: tuple[int, ...]
    """Tokens new since the previous chunk; empty only on the final chunk."""
    finish_reason: str | None
    """"stop" | "length" | "abort", or None while running; the last chunk has one."""
    stop_reason: str | int | None
    """The stop string or stop token id that ended the request (None for EOS or length)."""
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the KV cache instead of being computed."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per token of ``token_ids`` when the request asked for logprobs."""


class Backend(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: Tokenizer
    image_token_id: int | None
    """The placeholder token an image takes in the prompt; None: the model takes no images."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Tokens for ``request`` as they come; closing the iterator cancels the request."""
        ...

    async def is_healthy(self) -> bool:
        ...

