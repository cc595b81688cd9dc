"""Next-token sampling for the torch engine: greedy, temperature and nucleus (top-p), one RNG per request.

Every request owns a `torch.Generator`, so a seeded request draws the same tokens whatever other
requests share its decode batch. The log-probability reported for a token is always the policy's
own: the log-softmax of the raw logits (temperature 1, no top-p), which is what a trainer recomputes.
"""

from __future__ import annotations

import random

import torch

from gyre_ray.engines.base import SamplingParams

_SEED_SOURCE = random.SystemRandom()


def make_generator(seed: int | None, draws_done: int = 0) -> tuple[torch.Generator, int]:
    """A CPU generator seeded with `seed`, or with a fresh random seed when None; returns (gen, seed).

    A seeded generator is advanced past `draws_done` draws of `sample_rows` (one float64 per sampled
    token), so a request continued from `draws_done` tokens draws what the unbroken request would have
    (a greedy request never draws: advancing its generator changes nothing)."""
    if seed is None:
        seed, draws_done = _SEED_SOURCE.getrandbits(63), 0
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    for _ in range(draws_done):
        torch.rand(1, generator=gen, dtype=torch.float64)
    return gen, int(seed)


def as_float(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits upcast to float32; float32 / float64 kept as they are (as the trainer does)."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def nucleus_filter(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Zero every probability outside the smallest set whose mass reaches `top_p` (per row if a tensor)."""
    if not isinstance(top_p, torch.Tensor):
        if top_p >= 1.0:
            return probs
        top_p = torch.tensor(top_p)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p.to(probs.dtype).reshape(
        *top_p.shape, *([1] * (probs.dim() - top_p.dim()))
    )
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # the top token is always kept
    return torch.where(keep, probs, torch.zeros_like(probs))


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Sample one token per row of (B, V) `logits`; return the tokens and their raw-logit log-probs.

    Greedy rows take the argmax. Sampled rows draw one uniform number each from their own generator
    and invert the cumulative distribution of softmax(logits / temperature) after top-p filtering.
    """
    logits = as_float(logits)
    logprobs = torch.log_softmax(logits, dim=-1)
    rows = [b for b, p in enumerate(params) if p.temperature > 0]
    if len(rows) < len(params):
        tokens = torch.argmax(logits, dim=-1)
    else:
        tokens = torch.zeros(logits.size(0), dtype=torch.long, device=logits.device)
    if rows:
        index = torch.tensor(rows, device=logits.device)
        temperature = torch.tensor(
            [params[b].temperature for b in rows], dtype=logits.dtype, device=logits.device
        )
        probs = torch.softmax(logits[index] / temperature.unsqueeze(1), dim=-1)
        top_p = [params[b].top_p for b in rows]
        if min(top_p) < 1.0:
            probs = nucleus_filter(probs, torch.tensor(top_p, device=logits.device))
        cdf = torch.cumsum(probs, dim=-1)
        uniform = torch.cat([torch.rand(1, generator=generators[b], dtype=torch.float64) for b in rows])
        target = uniform.to(device=logits.device, dtype=cdf.dtype) * cdf[:, -1]
        picked = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
        tokens[index] = picked.clamp_(max=logits.size(-1) - 1)
    picked_logprobs = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens.tolist(), picked_logprobs.tolist()
