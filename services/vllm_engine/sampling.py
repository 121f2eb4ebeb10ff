"""epd's SamplingParams as vLLM's: every field the router sends, with the same meaning.

=========================  ==================================================================
epd                        vLLM
=========================  ==================================================================
temperature, top_p, min_p  the same fields (0 is greedy in both)
top_k                      top_k; epd's 0 (off) is vLLM's -1
presence/frequency,        the same fields: presence and frequency count output tokens,
repetition_penalty         repetition prompt and output, in both
max_tokens, min_tokens     the same, less what was generated before (a resumed request)
seed                       seed (a per-request generator in both)
stop, stop_token_ids,      the same (a stop string ends the output before it, the token that
ignore_eos                 completed it kept in token_ids, in both)
logprobs                   logprobs (top alternatives of the raw logits, the sampled token's own)
logit_bias                 logit_bias ({token id: bias})
structured                 structured_outputs: json (schema), json_object, regex, grammar
                           (EBNF), structural_tag; vLLM compiles them with its own backend
skip_special_tokens        the router detokenizes; vLLM's text is not used
num_speculative_tokens     a speed knob with no effect on outputs: accepted, not passed (vLLM
                           has no per-request draft length)
=========================  ==================================================================
"""

from __future__ import annotations

import json

from vllm import SamplingParams as VllmSamplingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from services.common.sampling_params import SamplingParams, TokenLogprobs


def to_vllm(params: SamplingParams, num_generated: int = 0, max_tokens: int | None = None,
            kv_transfer_params: dict | None = None) -> VllmSamplingParams:
    """vLLM's parameters for ``params``, for a request that already generated ``num_generated``
    tokens elsewhere (they count against max_tokens and min_tokens); ``max_tokens`` caps it
    further (a prefill's 1)."""
    left = params.max_tokens - num_generated
    return VllmSamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1, min_p=params.min_p,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        max_tokens=left if max_tokens is None else min(left, max_tokens),
        min_tokens=min(max(0, params.min_tokens - num_generated), left),
        seed=params.seed, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, logprobs=params.logprobs, logit_bias=dict(params.logit_bias) or None,
        structured_outputs=structured(params), skip_special_tokens=params.skip_special_tokens,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)


def structured(params: SamplingParams) -> StructuredOutputsParams | None:
    spec = params.structured
    if spec is None:
        return None
    if spec.kind == "json_schema":
        return StructuredOutputsParams(json=json.loads(spec.spec))
    if spec.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if spec.kind == "regex":
        return StructuredOutputsParams(regex=spec.spec)
    if spec.kind == "grammar":
        return StructuredOutputsParams(grammar=spec.spec)
    tag = json.loads(spec.spec)  # epd's {"triggers", "tags"} as vLLM's (xgrammar's) structures
    return StructuredOutputsParams(structural_tag=json.dumps(
        {"type": "structural_tag", "structures": tag["tags"], "triggers": tag["triggers"]}))


def token_logprobs(entries, token_ids, num_top: int) -> tuple[TokenLogprobs, ...]:
    """vLLM's per-token logprobs ({token id: Logprob(logprob, rank, ...)} each: the ``num_top``
    most likely and the sampled token, whatever its rank) as epd's, alternatives most likely first."""
    if entries is None:
        return ()
    out = []
    for token_id, entry in zip(token_ids, entries):
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and 1 <= lp.rank <= num_top),
                     key=lambda item: item[1].rank)
        out.append(TokenLogprobs(token_id, entry[token_id].logprob,
                                 tuple((t, lp.logprob) for t, lp in top)))
    return tuple(out)
