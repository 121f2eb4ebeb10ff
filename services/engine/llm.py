"""The offline API: ``LLM(model).generate(prompts, params)`` and ``LLM.chat(conversations)``."""

from __future__ import annotations

from typing import Sequence as Seq

from services.common.errors import InvalidRequestError
from services.common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.outputs import RequestOutput

Prompt = str | list[int]


class LLM:
    """Runs requests to completion in one process, batched continuously.

    ``LLM()`` loads the default model (SmolLM2-135M-Instruct); ``LLM("path/to/model.gguf")``
    or ``LLM("path/to/hf_dir")`` loads another. Keyword arguments are :class:`EngineConfig`
    fields (``block_size``, ``max_num_batched_tokens``, ``kv_cache_gib``, ...).
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Outputs in prompt order. All prompts are validated before any runs."""
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(params, len(prompt_list))
        for prompt, p in zip(prompt_list, params_list):
            self.engine.validate(prompt, p)
        # Grammars too, so a bad one is rejected before any request is queued.
        grammars = [None if p.structured is None else self.engine.compile_grammar(p.structured) for p in params_list]
        ids = [self.engine.add_request(prompt, p, grammar=grammar)
               for prompt, p, grammar in zip(prompt_list, params_list, grammars)]
        finished: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        finally:
            for rid in ids:  # only non-empty after an exception (e.g. KeyboardInterrupt)
                if rid not in finished:
                    self.engine.abort_request(rid)
        return [finished[rid] for rid in ids]

    def chat(self, conversations: list[dict] | Seq[list[dict]],
             params: SamplingParams | Seq[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer, so it has no chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, params)

    @staticmethod
    def _as_prompt_list(prompts) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidRequestError("prompts must be a string, a token-id list, or a non-empty list of them")
        return list(prompts)

    @staticmethod
    def _as_params_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise InvalidRequestError(f"got {len(params)} SamplingParams for {n} prompts")
        return params
