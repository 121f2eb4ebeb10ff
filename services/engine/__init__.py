"""The epd engine: paged KV, continuous batching, a Llama-family model in torch.

Offline use::

    from services.engine import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=32))
    print(out[0].text)

Names are imported lazily so that torch-free submodules (scheduler, block manager, sequence)
can be imported without loading torch.
"""

from typing import TYPE_CHECKING

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from services.common.sampling_params import SamplingParams
    from services.engine.llm import LLM
    from services.engine.outputs import RequestOutput


def __getattr__(name: str):
    if name == "LLM":
        from services.engine.llm import LLM
        return LLM
    if name == "RequestOutput":
        from services.engine.outputs import RequestOutput
        return RequestOutput
    if name == "SamplingParams":
        from services.common.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
