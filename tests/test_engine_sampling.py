"""Sampling: nucleus filtering keeps the smallest set reaching top_p, per-request generators make
draws reproducible, and reported log-probs are the raw-logit log-softmax whatever the temperature."""

from __future__ import annotations

import torch

from gyre_ray.engines.base import SamplingParams
from gyre_ray.engines.sampling import make_generator, nucleus_filter, sample_rows


def test_nucleus_filter_keeps_the_smallest_set_reaching_top_p() -> None:
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    kept = nucleus_filter(probs, 0.7)
    assert kept.tolist() == [0.0, 0.5, 0.0, 0.25]
    assert nucleus_filter(probs, 0.5).tolist() == [0.0, 0.5, 0.0, 0.0]
    assert torch.equal(nucleus_filter(probs, 1.0), probs)
    assert nucleus_filter(probs, 1e-9).tolist() == [0.0, 0.5, 0.0, 0.0]  # the top token always survives


def test_seeded_generators_repeat_their_draws_and_logprobs_ignore_temperature() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_p=0.5),
    ]

    def draw():
        gens = [make_generator(p.seed if p.seed is not None else 5)[0] for p in params]
        return [sample_rows(logits, params, gens) for _ in range(5)]

    first, second = draw(), draw()
    assert first == second
    raw = torch.log_softmax(logits, -1)
    for tokens, logprobs in first:
        assert tokens[1] == int(logits[1].argmax())
        for row, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            assert abs(lp - float(raw[row, tok])) < 1e-6
    assert len({tuple(t) for t, _ in first}) > 1  # sampled rows vary from draw to draw


def test_unseeded_generators_get_distinct_seeds() -> None:
    seeds = {make_generator(None)[1] for _ in range(20)}
    assert len(seeds) == 20
