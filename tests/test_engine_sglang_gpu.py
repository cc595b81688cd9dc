"""The SGLang engine against a real SGLang server (GPU only; skipped without CUDA or the sglang package).

One server for the module, on GPU 0, loading a small random Qwen3 saved as an HF folder, float32
with SGLang's torch-native attention so its log-probs can be compared with the torch engine's on
the same weights. `benchmarks/gpu_check.sh` runs these on a GPU machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gyre_ray.engines.base import GenerateRequest, SamplingParams
from gyre_ray.engines.config import EngineSection, SGLangOptions
from gyre_ray.engines.sglang import SGLangEngine, launch_engine
from gyre_ray.engines.testing import GREEDY, generate_alone, small_model, token_prompt
from gyre_ray.model.checkpoint import save_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None or not torch.cuda.is_available(),
        reason="real SGLang needs the sglang package and a CUDA GPU",
    ),
]
EXTRA = ["--dtype", "float32", "--attention-backend", "torch_native", "--disable-cuda-graph"]
LOGPROB_ATOL = 2e-3  # float32 on both sides; different kernels


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SGLangEngine, torch.nn.Module]]:
    model = small_model()
    folder = save_hf(model, model.args, Path(tmp_path_factory.mktemp("sglang-model")))
    section = EngineSection(
        backend="sglang",
        max_batch_size=16,
        sglang=SGLangOptions(mem_fraction_static=0.3, extra_args=EXTRA, startup_timeout_s=300),
    )
    engine = launch_engine(
        section,
        model,
        model.args,
        stop_token_ids=[],
        model_dir=str(folder),
        cell_id="gpu-cell",
        gpu_ids=["0"],
    )
    yield engine, model
    engine.shutdown()


def test_real_sglang_generates_the_torch_engines_tokens_and_logprobs(served) -> None:
    engine, model = served
    request = GenerateRequest("gpu-1", token_prompt(9), SamplingParams(temperature=0.0, max_new_tokens=16))
    got = asyncio.run(engine.generate(request))
    want = generate_alone(model, request)
    assert got.finish_reason == "length" and got.output_ids == want.output_ids
    diff = (torch.tensor(got.output_logprobs) - torch.tensor(want.output_logprobs)).abs().max().item()
    assert diff < LOGPROB_ATOL, diff


def test_real_sglang_streams_and_aborts(served) -> None:
    engine, _ = served

    async def scenario():
        events = []

        async def consume():
            request = GenerateRequest(
                "gpu-2", token_prompt(8), SamplingParams(temperature=0.0, max_new_tokens=2000)
            )
            async for event in engine.stream(request):
                events.append(event)

        task = asyncio.create_task(consume())
        while len(events) < 3 and not task.done():
            await asyncio.sleep(0.005)
        partial = await engine.abort("gpu-2")
        await asyncio.wait_for(task, 60)
        return partial, events

    partial, events = asyncio.run(scenario())
    assert partial is not None and partial.finish_reason == "abort" and len(partial.output_ids) < 2000
    assert events[-1].finish_reason == "abort"


def test_real_sglang_releases_resumes_and_loads_new_weights(served) -> None:
    engine, _ = served
    new = small_model(seed=4)
    request = GenerateRequest("gpu-3", token_prompt(7), GREEDY)

    async def scenario():
        await engine.release_memory()
        await engine.resume_memory()
        await engine.update_weights(new.state_dict(), 1)
        return await engine.generate(request), await engine.flush_cache()

    got, flushed = asyncio.run(scenario())
    assert got.output_ids == generate_alone(new, request).output_ids and got.output_versions == [1] * 12
    assert flushed is True


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL sender needs a GPU of its own")
def test_real_sglang_receives_an_nccl_weight_broadcast(served) -> None:
    from gyre_ray.engines.sglang.weight_sync import WeightBroadcaster
    from gyre_ray.ports import free_port

    engine, _ = served
    new = small_model(seed=6)
    request = GenerateRequest("gpu-4", token_prompt(7), GREEDY)

    async def scenario():
        sender = WeightBroadcaster([engine], "127.0.0.1", free_port(), group_name="gpu-test", device="cuda:1")
        await sender.connect()
        await sender.send(new.state_dict(), 2, bucket_bytes=1 << 20)
        return await engine.generate(request)

    got = asyncio.run(scenario())
    assert got.output_ids == generate_alone(new, request).output_ids and got.output_versions == [2] * 12
