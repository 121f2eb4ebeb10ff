import math

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.sampler import Sampler, SamplingRow, _apply_penalties, _inverse_cdf

VOCAB = 8


def make_row(prompt=(), output=(), suppressed=(), **params) -> SamplingRow:
    sampling = SamplingParams(**params)
    generator = None if sampling.seed is None else torch.Generator().manual_seed(sampling.seed)
    return SamplingRow(params=sampling, prompt_token_ids=list(prompt), output_token_ids=list(output),
                       generator=generator, suppressed_token_ids=tuple(suppressed))


def sample(logits, *rows):
    return Sampler()(torch.as_tensor(logits, dtype=torch.float32), list(rows))


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = random_logits(4)
    logits[3] = torch.tensor([0.0, 5.0, 1.0, 5.0, 0.0, 0.0, 0.0, 0.0])
    rows = [make_row(temperature=0.0, top_k=3, top_p=0.5) for _ in range(4)]
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3] == 1
    assert out.logprobs == [None] * 4


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # Seen: 0 (prompt), 1 (output), 2 (prompt). Token 3 is unseen and starts below token 0.
    logits = [[4.0, -1.0, 3.0, 2.5, -9.0, -9.0, -9.0, -9.0]]
    out = sample(logits, make_row(prompt=[0, 2], output=[1], temperature=0.0, repetition_penalty=2.0))
    # Penalised: [2.0, -2.0, 1.5, 2.5, ...] -> 3 now wins.
    assert out.token_ids == [3]
    out = sample(logits, make_row(prompt=[0, 2], output=[1], temperature=0.0, repetition_penalty=1.5))
    # Penalised: [2.667, -1.5, 2.0, 2.5, ...] -> 0 still wins.
    assert out.token_ids == [0]


def test_frequency_penalty_subtracts_per_output_occurrence_only():
    logits = [[5.0, 3.9, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    # Token 0 twice in output -> 5 - 2 * 0.6 = 3.8 < 3.9; prompt occurrences don't count.
    out = sample(logits, make_row(prompt=[1, 1, 1], output=[0, 0], temperature=0.0, frequency_penalty=0.6))
    assert out.token_ids == [1]
    # Once -> 4.4 > 3.9.
    out = sample(logits, make_row(prompt=[1, 1, 1], output=[0], temperature=0.0, frequency_penalty=0.6))
    assert out.token_ids == [0]


def test_presence_penalty_subtracts_once_per_seen_output_token():
    logits = [[5.0, 3.9, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    # 5 - 1.2 = 3.8 however often token 0 appeared.
    out = sample(logits, make_row(output=[0, 0, 0, 0], temperature=0.0, presence_penalty=1.2))
    assert out.token_ids == [1]
    out = sample(logits, make_row(output=[0, 0, 0, 0], temperature=0.0, presence_penalty=1.0))
    assert out.token_ids == [0]


def test_penalised_logits_match_hand_computed_values():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -0.5, 1.5, 0.0, 0.25]])
    row = make_row(prompt=[0, 1, 7], output=[2, 2, 3, 1], repetition_penalty=2.0,
                   frequency_penalty=0.5, presence_penalty=0.25)
    _apply_penalties(logits, [row])
    expected = [
        2.0 / 2,                   # prompt only: repetition
        -2.0 * 2 - 0.5 - 0.25,     # prompt and output once
        1.0 / 2 - 2 * 0.5 - 0.25,  # output twice
        0.5 / 2 - 0.5 - 0.25,      # output once
        -0.5, 1.5, 0.0,            # unseen
        0.25 / 2,                  # prompt only
    ]
    assert logits[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_out_of_vocab_prompt_ids_are_ignored_by_penalties():
    logits = [[1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    # Row 0's id VOCAB (an image placeholder) must not penalise row 1's token 0.
    rows = [make_row(prompt=[VOCAB, -1], temperature=0.0, repetition_penalty=10.0),
            make_row(prompt=[1], temperature=0.0, repetition_penalty=10.0)]
    assert sample(logits, *rows).token_ids == [1, 0]


def test_top_k_one_equals_greedy():
    logits = random_logits(16)
    rows = [make_row(temperature=1.5, top_k=1) for _ in range(16)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_only_the_k_best():
    logits = random_logits(1).expand(500, VOCAB).contiguous()
    top3 = set(logits[0].topk(3).indices.tolist())
    rows = [make_row(temperature=5.0, top_k=3) for _ in range(500)]
    torch.manual_seed(0)
    assert set(Sampler()(logits, rows).token_ids) == top3


def test_tiny_top_p_keeps_only_the_top_token():
    logits = random_logits(16)
    rows = [make_row(temperature=2.0, top_p=1e-6) for _ in range(16)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs ~ [0.5, 0.3, 0.15, 0.05]: p=0.7 needs tokens 0 and 1, never 2 or 3.
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(2000, 4).contiguous()
    torch.manual_seed(0)
    out = Sampler()(logits, [make_row(top_p=0.7) for _ in range(2000)])
    assert set(out.token_ids) == {0, 1}


def test_top_p_applies_after_top_k_and_rows_without_it_keep_their_k():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(2000, 4).contiguous()
    rows = [make_row(top_k=3, top_p=0.7) if i % 2 else make_row(top_k=3) for i in range(2000)]
    torch.manual_seed(0)
    tokens = Sampler()(logits, rows).token_ids
    assert set(tokens[1::2]) == {0, 1}
    assert set(tokens[0::2]) == {0, 1, 2}


def test_min_p_filters_tokens_below_fraction_of_top():
    # probs ~ [0.5, 0.3, 0.15, 0.05]; min_p=0.4 -> threshold 0.2 keeps 0 and 1.
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(2000, 4).contiguous()
    torch.manual_seed(0)
    out = Sampler()(logits, [make_row(min_p=0.4) for _ in range(2000)])
    assert set(out.token_ids) == {0, 1}


def test_suppressed_ids_are_never_sampled_greedy_or_random():
    logits = torch.zeros(1000, VOCAB)
    logits[:, 2] = 10.0
    rows = [make_row(temperature=0.0 if i % 2 else 1.0, suppressed=(2, 5)) for i in range(1000)]
    torch.manual_seed(0)
    tokens = Sampler()(logits, rows).token_ids
    assert not {2, 5} & set(tokens)
    assert tokens[1] == 0  # greedy among the remaining all-zero logits: lowest id


def test_inverse_cdf_never_picks_zero_probability_tokens_at_the_edges():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    # u = 0 lands on the leading zero's boundary, u = 0.5 on the middle zero's, and the largest
    # float32 below 1 just short of the trailing zero.
    u = torch.tensor([0.0, 0.5, 0.25, 1.0 - 2.0 ** -24])
    assert _inverse_cdf(probs, u).tolist() == [1, 3, 1, 3]
    # Unnormalised mass (min-p zeroes tokens without renormalising) gives the same answer.
    assert _inverse_cdf(probs * 3.0, u).tolist() == [1, 3, 1, 3]


def run_steps(seed_row_position: int, other_rows, steps: int = 20, vocab: int = 64) -> list[int]:
    """Tokens of a seeded row over several steps, placed among other_rows (rebuilt each step)."""
    seeded = make_row(seed=1234, temperature=0.9, top_k=40, top_p=0.95, min_p=0.01,
                      repetition_penalty=1.1)
    tokens = []
    for step in range(steps):
        others = [make_row(**p) for p in other_rows]
        rows = others[:seed_row_position] + [seeded] + others[seed_row_position:]
        logits = random_logits(len(rows), vocab, seed=1000 + step * 100 + len(rows))
        logits[seed_row_position] = random_logits(1, vocab, seed=step)[0]
        out = Sampler()(logits, rows)
        tokens.append(out.token_ids[seed_row_position])
        seeded.output_token_ids = [*seeded.output_token_ids, tokens[-1]]
    return tokens


def test_seeded_row_is_independent_of_batch_size_and_position():
    alone = run_steps(0, [])
    others = [dict(seed=7), dict(), dict(temperature=0.0), dict(seed=99, top_k=5), dict(top_p=0.5),
              dict(presence_penalty=0.5, logprobs=3), dict(min_p=0.2)]
    torch.manual_seed(123)
    in_batch = run_steps(5, others)
    assert in_batch == alone
    assert len(set(alone)) > 3  # really sampling, not collapsed to one token


def test_different_seeds_give_different_streams():
    def stream(seed: int) -> list[int]:
        row = make_row(seed=seed)
        logits = torch.zeros(1, 64)
        return [Sampler()(logits, [row]).token_ids[0] for _ in range(20)]

    assert stream(1) == stream(1)
    assert stream(1) != stream(2)


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_distribution_matches_softmax_of_scaled_logits(seeded):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature, num_samples = 0.7, 4000
    expected = torch.softmax(logits / temperature, dim=-1) * num_samples
    if seeded:
        row = make_row(seed=5, temperature=temperature)
        tokens = [Sampler()(logits.unsqueeze(0), [row]).token_ids[0] for _ in range(num_samples)]
    else:
        torch.manual_seed(0)
        rows = [make_row(temperature=temperature) for _ in range(num_samples)]
        tokens = Sampler()(logits.expand(num_samples, 6).contiguous(), rows).token_ids
    observed = torch.bincount(torch.tensor(tokens), minlength=6).float()
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: p(chi2 > 25) ~ 1e-4; with fixed seeds this is deterministic anyway.
    assert chi_square < 25.0


def test_logprobs_come_from_raw_logits_with_top_in_order():
    logits = random_logits(3)
    rows = [make_row(temperature=0.0, logprobs=3, repetition_penalty=2.0, prompt=[0, 1, 2]),
            make_row(logprobs=0, temperature=0.5),
            make_row(temperature=0.0)]
    out = Sampler()(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(expected[0, out.token_ids[0]].item(), abs=1e-6)
    order = expected[0].argsort(descending=True)[:3].tolist()
    assert [t for t, _ in first.top] == order
    assert [v for _, v in first.top] == pytest.approx(expected[0, order].tolist(), abs=1e-6)
    assert out.logprobs[1].top == ()
    assert out.logprobs[1].logprob == pytest.approx(expected[1, out.token_ids[1]].item(), abs=1e-6)
    assert out.logprobs[2] is None


def test_bf16_logits_are_accepted_and_not_modified():
    logits = random_logits(4).to(torch.bfloat16)
    before = logits.clone()
    rows = [make_row(temperature=0.0, logprobs=2, repetition_penalty=1.2, prompt=[1], suppressed=(0,)),
            make_row(seed=3, top_k=4, top_p=0.9),
            make_row(min_p=0.1, frequency_penalty=0.5, output=[2]),
            make_row(temperature=0.0)]
    out = Sampler()(logits, rows)
    assert out.token_ids[3] == logits.float()[3].argmax().item()
    assert all(0 <= t < VOCAB for t in out.token_ids)
    assert out.logprobs[0].logprob == pytest.approx(
        torch.log_softmax(logits.float(), dim=-1)[0, out.token_ids[0]].item(), abs=1e-6)
    assert torch.equal(logits, before)


def test_fp32_logits_are_not_modified_by_penalties_or_suppression():
    logits = random_logits(2)
    before = logits.clone()
    rows = [make_row(repetition_penalty=1.5, prompt=[0, 1], suppressed=(2,)), make_row(presence_penalty=1.0)]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)
    assert not math.isnan(float(logits.sum()))
