"""Small models and engines for tests: a random Qwen3 small enough to decode hundreds of tokens a second.

`small_model()` uses a wider initialisation than the model's default (std 0.2 rather than 0.02) so
that greedy continuations vary instead of repeating one token, which makes token-equality tests
meaningful. Other packages' tests (the proxy, cells) may use these too.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gyre_ray.engines.base import SamplingParams
from gyre_ray.engines.torch_engine import TorchEngine
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)  # 12 argmax tokens, no stop token


def small_args(vocab_size: int = 512, context: int = 1024) -> ModelArgs:
    """Two layers, 64 wide, grouped-query attention (4 query / 2 KV heads); eos id 0."""
    return ModelArgs(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=context,
        eos_token_id=0,
    )


def small_model(seed: int = 0, args: ModelArgs | None = None) -> Qwen3ForCausalLM:
    """A seeded random Qwen3 of `small_args()` (or `args`), init std 0.2, in eval mode."""
    return init_weights(Qwen3ForCausalLM(args or small_args()), seed, std=0.2).eval()


def small_engine(model: Qwen3ForCausalLM | None = None, **options: Any) -> TorchEngine:
    """A torch engine over `model` (default: small_model()) with no implied stop token and no prefix
    cache unless `options` say otherwise."""
    model = model if model is not None else small_model()
    options.setdefault("prefix_cache_tokens", 0)
    options.setdefault("stop_token_ids", [])
    return TorchEngine(model, model.args, **options)


def token_prompt(n: int, start: int = 3, vocab_size: int = 512) -> list[int]:
    """A deterministic prompt of `n` ids in [1, vocab_size) that differs with `start`."""
    return [(start + 7 * i) % (vocab_size - 1) + 1 for i in range(n)]


async def stream_until(engine: TorchEngine, request: Any, n: int) -> list[int]:
    """Start streaming `request` and return once it has produced `n` tokens; the stream keeps running
    in a background task (so the request is still in flight when this returns)."""
    got: list[int] = []
    ready = asyncio.Event()

    async def consume() -> None:
        async for event in engine.stream(request):
            got.append(event.token_id)
            if len(got) >= n:
                ready.set()
        ready.set()

    task = asyncio.get_running_loop().create_task(consume())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    await ready.wait()
    return list(got)


_BACKGROUND: set[Any] = set()  # keeps background stream tasks referenced until they finish


def generate_alone(model: Qwen3ForCausalLM, request: Any, **options: Any) -> Any:
    """Run one request to completion on a fresh engine over `model` (then shut it down)."""
    engine = small_engine(model, **options)
    try:
        return asyncio.run(engine.generate(request))
    finally:
        engine.shutdown()
