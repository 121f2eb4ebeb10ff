"""Oracle tests: our model against Hugging Face transformers with the same weights.

transformers is the reference no one here wrote. With ``exact_prefill`` a fresh prompt runs
exactly transformers' arithmetic (the same products, SDPA, norms), so its fp32 logits must equal
theirs bit for bit, except for a one-token prompt (see EXACT_ONE_ROW); by default (fresh prompts
through our attention kernel, fused norms where the CPU's kernels run) and in chunks they must
agree to 1e-4; greedy continuations of 64 tokens must be identical in both modes.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from services.engine import LLM, SamplingParams
from tests.factories import make_tiny_model_dir, random_prompts

HF_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 256}}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "no-gqa": ("llama", {"num_key_value_heads": 4}),
    # The hybrid family: sliding-window layers (a window of 24, across block edges) between full
    # ones; the prompts (300 tokens, 64 more generated) run far past the window.
    "qwen2-hybrid": ("qwen2", {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 24,
                               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
}


EXACT_ONE_ROW = 1e-6
"""A one-token prompt's products are MKL's one-row product (gemv), whose summation order on some
CPUs depends on the weight's address (seen on AMD Zen 3: transformers' weights lie where
safetensors put them, 40 bytes past a 64-byte line, ours on a line; 5e-7 apart). From two rows on,
MKL's product (sgemm) packs its operands first, and the bits are transformers' own."""


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_greedy_match_transformers(tmp_path, variant):
    arch, overrides = VARIANTS[variant]
    path = make_tiny_model_dir(tmp_path / variant, arch, seed=11, **overrides)
    hf = HF_CLASSES[arch].from_pretrained(path, torch_dtype=torch.float32).eval()
    ours = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=64)
    exact = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=64, exact_prefill=True)
    for prompt in random_prompts(3, [1, 37, 300], seed=2):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        got = exact.engine.prompt_logits(prompt)
        if len(prompt) > 1:
            assert torch.equal(got, expected)
        else:
            assert (got - expected).abs().max().item() <= EXACT_ONE_ROW
        for chunk_size in (None, 16):
            assert (ours.engine.prompt_logits(prompt, chunk_size=chunk_size) - expected).abs().max().item() <= 1e-4
        assert (exact.engine.prompt_logits(prompt, chunk_size=16) - expected).abs().max().item() <= 1e-4
    prompt = random_prompts(1, [77], seed=3)[0]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    theirs = hf_greedy(hf, prompt, 64)
    assert ours.generate(prompt, greedy)[0].token_ids == theirs
    assert exact.generate(prompt, greedy)[0].token_ids == theirs
