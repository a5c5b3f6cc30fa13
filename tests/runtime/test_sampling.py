"""The sampling math: logit_bias and the presence/frequency penalties change the logits exactly as OpenAI defines
them, log probabilities are a log-softmax of those logits (before temperature, top-k and top-p), the batched choice
is greedy where it should be, follows temperature, top-k and top-p, repeats with a seed and does not depend on the
other rows of the batch, and SamplingParams.check names the field of every value out of range."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from llmeasyquant.runtime.requests import MAX_BIAS_ENTRIES, RequestError, SamplingParams
from llmeasyquant.runtime.sampling import RequestSampler, _inverse_cdf, choose_tokens, token_logprobs

VOCAB = 50


def logits_row(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def logits_rows(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def reference_log_softmax(logits: torch.Tensor) -> list[float]:
    """log(exp(x_i) / sum_j exp(x_j)) in float64, written out (not torch's log_softmax)."""
    values = logits.double().tolist()
    top = max(values)
    total = sum(math.exp(v - top) for v in values)
    return [v - top - math.log(total) for v in values]


def sampler(seed: int | None = 0, **options) -> RequestSampler:
    return RequestSampler(SamplingParams(**options), VOCAB, seed)


def next_token(one: RequestSampler, logits: torch.Tensor) -> tuple[int, object]:
    """One sampler's choice from one row of logits [vocab], as a batch of one."""
    tokens, logprobs = choose_tokens(logits.unsqueeze(0), [one])
    return tokens[0], logprobs[0]


def decode(samplers: list[RequestSampler], steps: int, keys: list[int] | None = None) -> list[list[int]]:
    """Each sampler's tokens over `steps` steps of random logits, decoded together; row i's logits at step s are
    seeded by (s, keys[i]) (default: i), so that a row's logits can be the same wherever it sits in the batch."""
    keys = keys if keys is not None else list(range(len(samplers)))
    out: list[list[int]] = [[] for _ in samplers]
    for step in range(steps):
        logits = torch.stack([logits_row(1000 * step + key) for key in keys])
        tokens, _ = choose_tokens(logits, samplers)
        for row, token in zip(out, tokens, strict=True):
            row.append(token)
    return out


# bias, penalties and log probabilities ---------------------------------------------------------------------------


def test_bias_and_penalties_change_the_logits_as_specified() -> None:
    shaping = sampler(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.7,
                      logit_bias={3: 5.0, 7: -100.0, 9: 1.5})
    generated = [3, 3, 9, 12, 3, 40]
    for token in generated:
        shaping.count(token)
    bias = {3: 5.0, 7: -100.0, 9: 1.5}
    for token in range(VOCAB):
        count = generated.count(token)
        expected = bias.get(token, 0.0) - 0.5 * (count > 0) - 0.7 * count
        assert shaping.offset[token].item() == pytest.approx(expected, abs=1e-5), token
    untouched = [t for t in range(VOCAB) if t not in bias and t not in generated]
    assert torch.equal(shaping.offset[untouched], torch.zeros(len(untouched)))  # the rest as the model gave them


def test_negative_penalties_favour_repeats() -> None:
    shaping = sampler(temperature=0.0, presence_penalty=-1.0, frequency_penalty=-0.25)
    for token in (4, 4):
        shaping.count(token)
    assert shaping.offset[4].item() == pytest.approx(1.0 + 0.5, abs=1e-6)


def test_greedy_choice_follows_bias_and_penalties() -> None:
    logits = torch.zeros(VOCAB)
    logits[0], logits[1] = 2.0, 1.9
    assert next_token(sampler(temperature=0.0, logit_bias={8: 2.5}), logits)[0] == 8
    assert next_token(sampler(temperature=0.0, logit_bias={0: -100}), logits)[0] == 1
    penalised = sampler(temperature=0.0, frequency_penalty=0.2)
    # 0 first; then 0 has lost 0.2 and 1 leads; then both have lost 0.2 and 0 leads again.
    assert [next_token(penalised, logits)[0] for _ in range(3)] == [0, 1, 0]
    logits[0], logits[1] = 1.5, 1.4
    present = sampler(temperature=0.0, presence_penalty=2.0)
    # Once generated, 0 and 1 fall below the untouched zeros, however often: 2 comes next, and again.
    assert [next_token(present, logits)[0] for _ in range(4)] == [0, 1, 2, 3]


def test_the_steps_logits_are_not_written_to() -> None:
    logits = logits_rows(3)
    choose_tokens(logits, [sampler(temperature=0.0, logit_bias={5: 9.0}), sampler(seed=1, frequency_penalty=1.0),
                           sampler(seed=2, top_k=3, top_p=0.5, logprobs=2)])
    assert torch.equal(logits, logits_rows(3))


def test_logprobs_equal_a_log_softmax_computed_apart() -> None:
    logits = logits_row(3)
    reference = reference_log_softmax(logits)
    [entry] = token_logprobs(logits.unsqueeze(0), [17], 5, [0])
    assert entry.token == 17 and entry.logprob == pytest.approx(reference[17], abs=1e-5)
    ids = [token for token, _ in entry.top]
    assert ids == sorted(range(VOCAB), key=lambda t: -reference[t])[:5]  # the 5 likeliest, likeliest first
    assert [value for _, value in entry.top] == pytest.approx([reference[t] for t in ids], abs=1e-5)
    assert all(a >= b for (_, a), (_, b) in zip(entry.top, entry.top[1:], strict=False))
    assert token_logprobs(logits.unsqueeze(0), [17], 0, [0])[0].top == ()
    assert len(token_logprobs(logits.unsqueeze(0), [17], 20, [0])[0].top) == 20


def test_each_row_gets_as_many_alternatives_as_it_asks() -> None:
    logits = logits_rows(3, seed=8)
    together = token_logprobs(logits, [1, 2, 3], [0, 4, 2], [0, 0, 0])
    assert together == [token_logprobs(logits[i:i + 1], [i + 1], top, [0])[0] for i, top in enumerate([0, 4, 2])]
    greedy = [sampler(temperature=0.0, logprobs=top) for top in (None, 4, 2)]
    tokens, entries = choose_tokens(logits, greedy)
    assert entries[0] is None and [len(e.top) for e in entries[1:]] == [4, 2]
    assert entries[1:] == token_logprobs(logits[1:], tokens[1:], [4, 2], [0, 0])


def test_logprobs_are_of_the_biased_logits_before_temperature_and_filters() -> None:
    shaping = sampler(seed=1, temperature=0.5, top_k=3, top_p=0.5, logit_bias={2: 4.0}, logprobs=3,
                      frequency_penalty=1.0)
    logits = logits_row(4)
    first, entry = next_token(shaping, logits)
    expected = logits.clone()
    expected[2] += 4.0
    reference = reference_log_softmax(expected)
    assert entry.logprob == pytest.approx(reference[first], abs=1e-5)  # not of logits / 0.5, nor top-k's
    assert [t for t, _ in entry.top] == sorted(range(VOCAB), key=lambda t: -reference[t])[:3]
    second, entry = next_token(shaping, logits)
    expected[first] -= 1.0  # the first token has been generated once
    assert entry.logprob == pytest.approx(reference_log_softmax(expected)[second], abs=1e-5)


@pytest.mark.parametrize("options", [{"temperature": 0.0}, {"temperature": 0.9, "top_k": 10, "top_p": 0.8}])
def test_logprobs_alone_choose_the_tokens_the_plain_path_does(options: dict) -> None:
    plain, asking = sampler(seed=3, **options), sampler(seed=3, logprobs=2, **options)
    assert plain.offset is None and asking.offset is None
    assert decode([plain], 20) == decode([asking], 20)


def test_a_plain_request_gets_no_sampler_state() -> None:
    for plain in (sampler(logprobs=0), sampler(presence_penalty=0.0, logit_bias={})):
        assert plain.offset is None and not plain.penalised
    assert sampler(temperature=0.0).rng is None  # greedy: no generator, no draws


# the batched choice ----------------------------------------------------------------------------------------------


def test_greedy_rows_are_the_argmax_of_their_shaped_logits_in_a_mixed_batch() -> None:
    logits = logits_rows(6, seed=5)
    rows = [sampler(temperature=0.0), sampler(seed=1, temperature=1.3), sampler(temperature=0.0, logit_bias={7: 50}),
            sampler(seed=2, top_p=0.3), sampler(temperature=0.0, top_k=3, top_p=0.1, logprobs=1),
            sampler(seed=3, top_k=2, logit_bias={1: -100})]
    tokens, _ = choose_tokens(logits, rows)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == 7 and tokens[4] == int(logits[4].argmax())
    # Sampled rows choose within their filters: row 5's two likeliest once token 1 is pushed to the bottom.
    shaped = logits[5].clone()
    shaped[1] -= 100
    assert tokens[5] in shaped.topk(2).indices.tolist()


@pytest.mark.parametrize("options", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5}],
                         ids=["top_k=1", "top_p-tiny", "both"])
def test_a_filter_that_keeps_one_token_is_greedy(options: dict) -> None:
    rows = [sampler(seed=seed, temperature=1.7, **options) for seed in range(8)]
    logits = logits_rows(8, seed=6)
    for _ in range(5):
        assert choose_tokens(logits, rows)[0] == logits.argmax(-1).tolist()


def test_a_seed_repeats_its_tokens_and_another_seed_does_not() -> None:
    options = {"temperature": 1.0, "top_k": 20, "top_p": 0.95}
    first, again, other = decode([sampler(seed=7, **options)], 30), decode([sampler(seed=7, **options)], 30), \
        decode([sampler(seed=8, **options)], 30)
    assert first == again
    assert first != other


def test_a_rows_tokens_do_not_depend_on_the_rest_of_the_batch() -> None:
    def row() -> RequestSampler:
        return sampler(seed=11, temperature=0.8, top_k=12, top_p=0.9)

    alone = decode([row()], 25, keys=[99])[0]
    assert len(set(alone)) > 5  # sampled, not stuck on one token

    def neighbours() -> list[RequestSampler]:
        return [sampler(temperature=0.0), sampler(seed=1, top_k=40), sampler(seed=2, top_p=0.2, logprobs=3),
                sampler(seed=3, frequency_penalty=2.0, logit_bias={4: 3.0}), sampler(seed=4, temperature=2.0)]

    # First, last and in the middle of other rows (its logits the same in each: key 99).
    assert decode([row(), *neighbours()], 25, keys=[99, 0, 1, 2, 3, 4])[0] == alone
    assert decode([*neighbours(), row()], 25, keys=[0, 1, 2, 3, 4, 99])[-1] == alone
    assert decode([*neighbours()[:2], row(), *neighbours()[2:]], 25, keys=[0, 1, 99, 2, 3, 4])[2] == alone


def test_temperature_top_k_and_top_p_give_their_distributions() -> None:
    """Each of 20,000 rows of the same logits draws once with its own seed: the frequencies are the probabilities
    (within 0.015, over four standard deviations at this count), and not those of another temperature."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    draws = 20_000

    def frequencies(**options) -> torch.Tensor:
        rows = [RequestSampler(SamplingParams(**options), 4, seed) for seed in range(draws)]
        counts = Counter(choose_tokens(logits.expand(draws, 4), rows)[0])
        return torch.tensor([counts[t] / draws for t in range(4)])

    cold = (logits / 0.5).softmax(-1)  # temperature 0.5: [0.676, 0.243, 0.061, 0.007]
    assert (cold - probs).abs().max() > 0.1  # far enough apart that ignoring the temperature fails
    torch.testing.assert_close(frequencies(temperature=0.5), cold, atol=0.015, rtol=0)
    torch.testing.assert_close(frequencies(temperature=1.0), probs, atol=0.015, rtol=0)
    torch.testing.assert_close(frequencies(top_k=2), torch.tensor([0.625, 0.375, 0, 0]), atol=0.015, rtol=0)
    # top_p 0.7: 0.5 and 0.3 reach it; 0.15 comes after 0.8 of mass and is dropped.
    torch.testing.assert_close(frequencies(top_p=0.7), torch.tensor([0.625, 0.375, 0, 0]), atol=0.015, rtol=0)
    torch.testing.assert_close(frequencies(top_p=0.85), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=0.015,
                               rtol=0)


def test_inverse_cdf_never_picks_a_token_of_probability_zero() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 5)
    largest = 1 - 2**-53  # the largest number random.random() gives: 1.0 in float32
    uniforms = torch.tensor([[0.0], [0.4999], [0.5], [0.99999], [largest]])
    assert _inverse_cdf(probs, uniforms).tolist() == [1, 1, 3, 3, 3]
    # A large vocabulary, half of it zeroed (as top-p leaves it), and many uniforms: only tokens that can come, come.
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(1, 50_000, generator=generator) ** 8
    probs[torch.rand(probs.shape, generator=generator) < 0.5] = 0.0
    many = torch.cat([torch.rand(300, 1, generator=generator), torch.tensor([[0.0], [largest]])])
    picked = _inverse_cdf(probs.expand(len(many), -1), many)
    assert bool((probs[0, picked] > 0).all())
    # NaN logits: no token past the vocabulary, but an error that fails the step (as torch.multinomial raised).
    with pytest.raises(ValueError, match="not finite"):
        choose_tokens(torch.full((1, VOCAB), float("nan")), [sampler(seed=1)])
    # Probabilities that do not add up to 1 (top-p zeroed some): the uniform spans what is left.
    assert _inverse_cdf(torch.tensor([[0.2, 0.0, 0.2]]), torch.tensor([[0.6]])).tolist() == [2]


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"presence_penalty": -2.01}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty", "[-2, 2]"),
    ({"frequency_penalty": True}, "frequency_penalty", "[-2, 2]"),
    ({"logit_bias": {5: 100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "'5'"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias", f"0..{VOCAB - 1}"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", f"0..{VOCAB - 1}"),
    ({"logit_bias": dict.fromkeys(range(MAX_BIAS_ENTRIES + 1), 1.0)}, "logit_bias", str(MAX_BIAS_ENTRIES)),
    ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ({"logprobs": -1}, "logprobs", "[0, 20]"),
    ({"logprobs": True}, "logprobs", "[0, 20]"),
    ({"seed": 2**64}, "seed", "2**64"),
]


@pytest.mark.parametrize(("options", "param", "words"), BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_check_names_the_field_out_of_range(options: dict, param: str, words: str) -> None:
    with pytest.raises(RequestError) as error:
        SamplingParams(**options).check(VOCAB)
    assert error.value.param == param and error.value.status == 400
    assert words in str(error.value)


def test_check_takes_the_edges_of_each_range() -> None:
    SamplingParams(presence_penalty=-2, frequency_penalty=2.0, logit_bias={0: -100, VOCAB - 1: 100},
                   logprobs=20, seed=-(2**63)).check(VOCAB)
    SamplingParams(logit_bias=dict.fromkeys(range(MAX_BIAS_ENTRIES), 0.5), logprobs=0, seed=2**64 - 1).check()
    # Without the vocabulary size any integer key passes check(); the engine checks it against its vocabulary.
    SamplingParams(logit_bias={10**6: 1.0}).check()
