"""Batch invariance: a request's logits do not depend on the batch around it.

The CPU's kernels give it by default (every product packed, every token attending through its
role's kernel); ``batch_invariant=True`` makes it a requirement. The probe is a request's top-20
logprobs at every token (log_softmax of the raw logits: any change in any logit moves them all),
compared with ``==``, not a tolerance. It runs alone and in batches of 7 and 32 mixed requests
under a small token budget, so its prompt is chunked differently and its decode steps share the
batch with prefill chunks of others; on a plain model and on a hybrid one (sliding-window
layers), in each precision the machine computes natively (tests/factories.machine_dtypes), and
through a preemption, which computes its output tokens again.
"""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.engine import LLM, SamplingParams
from services.engine.kernels import cpu
from services.engine.kernels import select as kernel_select
from tests.factories import machine_dtypes, make_tiny_model_dir, random_prompts

PROBE = random_prompts(1, [150], seed=99)[0]
OTHERS = random_prompts(31, [5 + 13 * i for i in range(31)], seed=4)


def probe_logprobs(llm: LLM, num_others: int, params: SamplingParams) -> list:
    outs = llm.generate(OTHERS[:num_others // 2] + [PROBE] + OTHERS[num_others // 2:num_others], params)
    probe = outs[num_others // 2]
    return [(lp.token_id, lp.logprob, lp.top) for lp in probe.logprobs]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """Sliding-window layers (window 24, well inside the probe's 150 tokens) around a full one."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("hybrid-bi"), "qwen2", seed=5, num_hidden_layers=3,
                               use_sliding_window=True, sliding_window=24,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])


@pytest.mark.parametrize("dtype", machine_dtypes())
@pytest.mark.parametrize("mode", [{}, {"batch_invariant": True}], ids=["default", "required"])
@pytest.mark.parametrize("model", ["tiny_llama_dir", "hybrid_dir"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=20),
    SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=20),
], ids=["greedy", "seeded"])
def test_a_requests_logits_are_bit_identical_alone_and_in_batches_of_7_and_32(request, model, params, mode,
                                                                              dtype):
    model_dir = request.getfixturevalue(model)
    llm = LLM(str(model_dir), num_kv_blocks=1024, max_num_batched_tokens=64, dtype=dtype, **mode)
    assert llm.engine.runner.is_batch_invariant
    alone = probe_logprobs(llm, 0, params)
    assert probe_logprobs(llm, 6, params) == alone
    assert probe_logprobs(llm, 31, params) == alone
    # Alone again, its prompt chunked at other positions (37-token chunks): the sliding-window
    # layers' keys too fall into the same softmax updates (paged_prefill.c's lo).
    other_chunks = LLM(str(model_dir), num_kv_blocks=1024, max_num_batched_tokens=37, dtype=dtype, **mode)
    assert probe_logprobs(other_chunks, 0, params) == alone


@pytest.mark.parametrize("dtype", machine_dtypes())
def test_a_preempted_request_computes_its_output_again_to_the_same_bits(tiny_llama_dir, dtype):
    """Preemption by recompute runs the output tokens again, now as part of a long chunk: each
    still attends as the single-token decode that first computed it (attention.build_metadata),
    so what follows is the same. Without that rule the prefill kernel's other summation order
    moved the logits (fp32: ~1e-4; bf16: whole units)."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True, logprobs=20)
    prompts = random_prompts(4, [300, 280, 260, 240], seed=8)
    roomy = LLM(str(tiny_llama_dir), num_kv_blocks=1024, dtype=dtype)
    want = [[(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs] for o in roomy.generate(prompts, params)]
    # 4 x ~300 tokens in 70 blocks of 16 cannot all run at once: some are preempted mid-answer.
    tight = LLM(str(tiny_llama_dir), num_kv_blocks=70, max_num_batched_tokens=128, dtype=dtype)
    got = [[(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs] for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want


def test_with_batch_dependent_products_the_same_probe_differs(tiny_llama_dir, monkeypatch):
    """The control: MKL's prompt products (``EPD_CPU_BLAS=mkl``) do depend on the batch (else the
    test above proves nothing)."""
    monkeypatch.setenv(kernel_select.BLAS_ENV, "mkl")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=20)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=1024, max_num_batched_tokens=64)
    alone = probe_logprobs(llm, 0, params)
    assert probe_logprobs(llm, 31, params) != alone


def test_speculative_verify_steps_keep_the_logits_too(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=20)
    plain = LLM(str(tiny_llama_dir), num_kv_blocks=1024, batch_invariant=True)
    spec = LLM(str(tiny_llama_dir), num_kv_blocks=1024, batch_invariant=True,
               speculative_config='{"num_speculative_tokens": 4, "prompt_lookup_min": 1}')
    prompt = PROBE[:20] * 4
    want = plain.generate([prompt], params)[0]
    got = spec.generate([prompt], params)[0]
    assert spec.engine.num_accepted_tokens > 0
    assert [(lp.token_id, lp.logprob, lp.top) for lp in got.logprobs] == \
        [(lp.token_id, lp.logprob, lp.top) for lp in want.logprobs]


def test_the_mode_says_what_it_needs_where_it_cannot_hold(tiny_llama_dir, monkeypatch):
    with pytest.raises(ConfigError, match="batch_invariant: needs the CPU's packed product for every step.*"
                                          "exact_prefill"):
        LLM(str(tiny_llama_dir), num_kv_blocks=64, batch_invariant=True, exact_prefill=True)
    monkeypatch.setenv("EPD_CPU_KERNELS", "0")   # torch's path: oneDNN / MKL products
    cpu.kernels.cache_clear()
    try:
        with pytest.raises(ConfigError, match="batch_invariant: needs .* this engine runs torch attention on cpu"):
            LLM(str(tiny_llama_dir), num_kv_blocks=64, batch_invariant=True)
        assert not LLM(str(tiny_llama_dir), num_kv_blocks=64).engine.runner.is_batch_invariant
    finally:
        cpu.kernels.cache_clear()


def test_the_mode_wins_over_a_batch_dependent_blas_setting(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv(kernel_select.BLAS_ENV, "mkl")
    assert not LLM(str(tiny_llama_dir), num_kv_blocks=64).engine.runner.is_batch_invariant
    required = LLM(str(tiny_llama_dir), num_kv_blocks=64, batch_invariant=True).engine.runner
    assert required.is_batch_invariant and required.product_kernels == ("packed-fp32", "packed-fp32")
