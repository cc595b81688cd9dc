"""Rollout cells in-process: planning, streaming, draining with KV export, resuming on another cell."""

from __future__ import annotations

import asyncio

import pytest

from gyre_ray.cells.cell import Migrated, Refused, RolloutCell, TokenBatch
from gyre_ray.cells.factories import PolicyEngineFactory, ScriptedEngineFactory
from gyre_ray.cells.pool import plan_cells
from gyre_ray.engines.base import GenerateRequest, SamplingParams


def test_plan_cells_one_bundle_per_cell():
    specs = plan_cells(3, 1.5, prefix="p")
    assert [s.cell_id for s in specs] == ["cell-0", "cell-1", "cell-2"]
    assert [s.actor_name for s in specs] == ["p-0", "p-1", "p-2"]
    assert all(s.bundles == [{"CPU": 1.5}] and s.torch_threads == 1 for s in specs)
    with pytest.raises(ValueError, match="num_cells"):
        plan_cells(0, 1.0)
    with pytest.raises(ValueError, match="cpus_per_cell"):
        plan_cells(1, 0.0)


async def _collect(stream, out: list[int], started: asyncio.Event | None = None, after: int = 0):
    """Append token ids from a cell stream; return the final non-token event (or None)."""
    last = None
    async for event in stream:
        if isinstance(event, TokenBatch):
            out.extend(e.token_id for e in event.events if e.token_id >= 0)
            if started is not None and len(out) >= after:
                started.set()
        else:
            last = event
    return last


async def _migrate_scenario(factory, prompts: list[list[int]], max_new: int, drain_after: int):
    source, target = RolloutCell("cell-0", factory), RolloutCell("cell-1", factory)
    await source.setup()
    await target.setup()
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=[])

    # undisturbed reference on the target's twin
    reference = []
    for i, prompt in enumerate(prompts):
        out: list[int] = []
        await _collect(source.generate(GenerateRequest(f"ref-{i}", prompt, sampling)), out)
        reference.append(out)

    outputs = [[] for _ in prompts]
    started = [asyncio.Event() for _ in prompts]
    tasks = [
        asyncio.create_task(
            _collect(
                source.generate(GenerateRequest(f"r-{i}", p, sampling)), outputs[i], started[i], drain_after
            )
        )
        for i, p in enumerate(prompts)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
    before = dict(target.engine.stats())
    moved = await source.drain()
    finals = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    assert moved == len(prompts) and all(isinstance(f, Migrated) for f in finals)
    refused = await _collect(source.generate(GenerateRequest("late", prompts[0], sampling)), [])
    assert isinstance(refused, Refused)

    resumed = []
    for i, final in enumerate(finals):
        continued = list(final.state.output_ids)
        assert continued[: len(outputs[i])] == outputs[i]  # the state holds everything streamed so far
        await _collect(target.resume(final.state), continued)
        resumed.append(continued)
    after = target.engine.stats()
    await source.undrain()
    assert not source.draining
    source.close()
    target.close()
    return reference, resumed, before, after


def test_scripted_cell_drain_moves_requests_and_output_is_unchanged():
    factory = ScriptedEngineFactory({"token_delay_s": 0.005, "reply_length": 1000})
    prompts = [[11, 12, 13, i] for i in range(8)]
    reference, resumed, before, after = asyncio.run(_migrate_scenario(factory, prompts, 40, 3))
    assert resumed == reference
    assert after["prefill_computed_tokens"] == before["prefill_computed_tokens"]
    assert after["imported"] - before["imported"] == 8


def test_torch_cell_drain_migrates_kv_without_recomputing_the_prefix():
    factory = PolicyEngineFactory()
    prompts = [[100 + j for j in range(30 + 7 * i)] for i in range(3)]
    reference, resumed, before, after = asyncio.run(_migrate_scenario(factory, prompts, 24, 4))
    assert resumed == reference  # greedy, so the move must not change a single token
    assert after["prefill_computed_tokens"] == before["prefill_computed_tokens"]
    assert after["imported"] - before["imported"] == 3
    assert after["imported_tokens"] - before["imported_tokens"] >= sum(len(p) for p in prompts)


def test_two_drains_at_once_migrate_a_request_once_and_never_abort_it():
    """An admin drain and the scheduler's switch may overlap: the second drain's export found the
    request already exported, reset its flag, and the request ended as an abort (its KV dropped, the
    call cut off). Now the second drain waits for the first's export."""
    from gyre_ray.engines.testing import small_engine

    async def scenario():
        cell = RolloutCell("c0", lambda: small_engine())
        await cell.setup()
        request = GenerateRequest(
            "r1", list(range(1, 20)), SamplingParams(temperature=0.0, max_new_tokens=900)
        )
        events, started = [], asyncio.Event()

        async def consume():
            async for event in cell.generate(request, session="s"):
                events.append(event)
                if isinstance(event, TokenBatch) and not started.is_set():
                    started.set()
                    await asyncio.sleep(0.3)  # a busy reader: both drains finish before it reads on

        task = asyncio.create_task(consume())
        await started.wait()
        moved = await asyncio.gather(cell.drain(), cell.drain())
        await task
        cell.close()
        return moved, events[-1]

    moved, last = asyncio.run(scenario())
    assert sorted(moved) == [0, 1] and isinstance(last, Migrated), (moved, last)


def test_a_drain_during_a_session_prefix_import_refuses_the_request():
    """A drain that began while a request awaited its session's KV import missed it (the import runs
    before the request is in flight): it then ran to the end on the drained cell, unmigrated."""
    import time

    from gyre_ray.engines.testing import small_engine
    from gyre_ray.transfer import Ticket

    async def scenario():
        cell = RolloutCell("c0", lambda: small_engine(prefix_cache_tokens=4096))
        await cell.setup()

        def slow_fetch(_ticket):
            time.sleep(0.3)
            raise RuntimeError("the sender is slow, then gone")

        cell._transport(cell.transfer.kv).fetch = slow_fetch
        request = GenerateRequest(
            "r1", list(range(1, 20)), SamplingParams(temperature=0.0, max_new_tokens=300)
        )
        events = []

        async def consume():
            async for event in cell.generate(
                request, session="s", prefix=Ticket("object_store", "kv", "c1", None, 0)
            ):
                events.append(event)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)  # importing
        moved = await cell.drain()
        await task
        cell.close()
        return moved, events

    moved, events = asyncio.run(scenario())
    assert moved == 0 and len(events) == 1 and isinstance(events[0], Refused), events


def test_an_engine_failure_while_the_request_is_exported_reaches_the_caller():
    """An engine failing while a drain exported its request was swallowed (a failure during an export
    is normally moot: the request continues elsewhere); when the export then found the request gone,
    the stream just ended, and the proxy answered 503 instead of retrying on another cell."""
    from gyre_ray.cells.cell import Failed
    from gyre_ray.cells.scripted_engine import ScriptedEngine
    from gyre_ray.engines.base import UnknownRequestError

    class BreaksOnExport(ScriptedEngine):
        broken = False

        async def stream(self, request):
            async for event in super().stream(request):
                if self.broken:
                    raise RuntimeError("device lost")
                yield event

        async def export_kv(self, rid):
            self.broken = True
            await asyncio.sleep(0.1)  # the stream fails meanwhile, and the request is gone
            raise UnknownRequestError(f"request {rid!r} is not running in this engine")

    async def scenario():
        cell = RolloutCell("c0", lambda: BreaksOnExport(token_delay_s=0.01, reply_length=1000))
        await cell.setup()
        sampling = SamplingParams(temperature=0.0, max_new_tokens=500, stop_token_ids=[])
        out: list[int] = []
        started = asyncio.Event()
        task = asyncio.create_task(
            _collect(cell.generate(GenerateRequest("r1", [1, 2, 3], sampling)), out, started, 2)
        )
        await started.wait()
        moved = await cell.drain()
        last = await asyncio.wait_for(task, timeout=10)
        cell.close()
        return moved, last

    moved, last = asyncio.run(scenario())
    assert moved == 0
    assert isinstance(last, Failed) and last.kind == "engine" and "device lost" in last.message, last
