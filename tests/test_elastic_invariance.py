"""The elastic update does not depend on how micro-batches were spread over cells or when cells joined.

Dual-role cells run in-process (a model-free scripted engine, a float64 tiny trainer); the step's
micro-batches go through the streaming queue in different interleavings: one core doing all, core +
satellite alternating, a satellite starting before the core with another joining late and the first
leaving mid-step. Each must give the single-trainer update of `gyre_ray.train` within 1e-6 relative.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from gyre_ray.algo.config import AlgoSection
from gyre_ray.algo.gspo import step_scale
from gyre_ray.cells.dual_role import DualRoleCell, TrainerFactory
from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.model.arch import ModelArgs
from gyre_ray.runtime.stream import MicroBatchStream
from gyre_ray.trainers.batch import MicroBatch
from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.pipeline import build_training_batches
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution
from gyre_ray.transfer import make_transport

MODEL = {"preset": "tiny", "dtype": "float64", "seed": 3}
TRAINER = {"lr": 1e-3, "grad_clip": 0.0}
ALGO = {"clip_low": 0.999, "clip_high": 1e6}  # keep every sequence unclipped: gradients everywhere
WORKLOAD = SyntheticWorkload(system_tokens=12, task_tokens=4, subagent_system_tokens=6, tool_tokens=(2, 5),
                             output_tokens=(2, 5), summary_tokens=4, turns=(2, 3), max_subagents=2,
                             vocab_size=ModelArgs.tiny().vocab_size)  # fmt: skip


def make_batches() -> list[MicroBatch]:
    records = {f"e{i}": synthetic_execution(f"e{i}", 40 + i, WORKLOAD)[0] for i in range(6)}
    rewards = {e: float((i % 3) ** 2) for i, e in enumerate(records)}  # no advantage of 0: all trained
    groups = {e: f"g{i // 3}" for i, e in enumerate(records)}
    traj = TrajectorySection(row_tokens=64, micro_batch_tokens=64)
    cfg = type("Cfg", (), {"trajectory": traj, "algo": AlgoSection(**ALGO)})()
    batches = build_training_batches(records, rewards, groups, cfg)
    assert len(batches) >= 6, "the test needs enough micro-batches to spread"
    return batches


async def new_cell(index: int) -> DualRoleCell:
    cell = DualRoleCell(
        f"cell-{index}", ScriptedEngineFactory(), TrainerFactory(MODEL, TRAINER, ALGO), torch_threads=1,
        is_core=index == 0,
    )  # fmt: skip
    await cell.setup()
    return cell


def reference_update(batches: list[MicroBatch]) -> tuple[dict[str, torch.Tensor], float]:
    """The single-trainer loop of gyre_ray.train: every micro-batch, then one scaled step."""
    trainer = TrainerFactory(MODEL, TRAINER, ALGO)()
    for b in batches:
        trainer.forward_backward(b)
    metrics = trainer.optimizer_step(step_scale(batches))
    return trainer.state_dict(), metrics["grad_norm"]


async def elastic_update(
    batches: list[MicroBatch], schedule: list[tuple[str, int]]
) -> tuple[dict[str, torch.Tensor], float, dict[str, int]]:
    """Run one step; `schedule` is a list of (event, cell): "join", "train" (claim + train), "leave"."""
    cells = {i: await new_cell(i) for i in sorted({c for _, c in schedule})}
    core = cells[0]
    start = await core.state_dict()  # what the driver publishes once (ray.put) for satellites to pull
    stream = MicroBatchStream()
    arrivals = iter(batches)
    for b in next(arrivals), next(arrivals):  # the first group's micro-batches are queued early
        stream.put(b, b.meta["execution_ids"])
    for event, index in schedule:
        cell = cells[index]
        if stream.queued == 0 and not stream.sealed:  # a later group ends: more micro-batches stream in
            for b in arrivals:
                stream.put(b, b.meta["execution_ids"])
            stream.seal()
        if event == "join":
            await cell.drain()
            await cell.to_training(None if cell.is_core else start, 0)
        elif event == "train":
            item = stream.claim(cell.cell_id)
            assert item is not None, "schedule claims more than there is"
            await cell.train(item.ref)
            stream.trained(item.index, cell.cell_id)
        elif event == "leave":  # a satellite goes back to rollout mid-step: its sum moves to the core first
            await core.import_grads(await cell.export_grads())
            await cell.to_rollout(start, 0)
            await cell.undrain()
    assert stream.complete, "schedule left micro-batches untrained"
    for cell in cells.values():
        if not cell.is_core and cell.role == "train":
            await core.import_grads(await cell.export_grads())
    metrics = await core.optimizer_step(stream.scale())
    for cell in cells.values():
        cell.close()
    return await core.state_dict(), metrics["grad_norm"], stream.trained_by_cell()


def _train(cell: int, n: int) -> list[tuple[str, int]]:
    return [("train", cell)] * n


@pytest.fixture(scope="module")
def batches() -> list[MicroBatch]:
    return make_batches()


@pytest.fixture(scope="module")
def reference(batches: list[MicroBatch]) -> tuple[dict[str, torch.Tensor], float]:
    return reference_update(batches)


def schedules(n: int) -> dict[str, list[tuple[str, int]]]:
    alternate = [("train", i % 2) for i in range(n)]
    late = (
        [("join", 1)] + _train(1, 2) + [("join", 2)] + _train(2, 1) + _train(1, 1) + [("leave", 1)]
        + [("join", 0)] + _train(0, 1) + _train(2, n - 6) + _train(0, 1)
    )  # fmt: skip
    return {
        "core-alone": [("join", 0)] + _train(0, n),
        "core-and-satellite-alternating": [("join", 0), ("join", 1)] + alternate,
        "satellites-first-core-late-one-leaves": late,
    }


@pytest.mark.parametrize(
    "name", ["core-alone", "core-and-satellite-alternating", "satellites-first-core-late-one-leaves"]
)
def test_update_is_independent_of_spread_and_join_times(batches, reference, name) -> None:
    ref_weights, ref_norm = reference
    schedule = schedules(len(batches))[name]
    weights, grad_norm, spread = asyncio.run(elastic_update(batches, schedule))
    assert sum(spread.values()) == len(batches)
    if name != "core-alone":
        assert len(spread) >= 2, f"{name}: micro-batches should be spread over cells, got {spread}"
    assert grad_norm > 0
    assert grad_norm == pytest.approx(ref_norm, rel=1e-6)
    start = TrainerFactory(MODEL, TRAINER, ALGO)().state_dict()
    for key, value in ref_weights.items():
        moved = (ref_weights[key] - start[key]).norm()
        assert moved > 0 or key.endswith("norm.weight")
        err = (weights[key] - value).norm()
        assert err <= 1e-6 * max(float(moved), 1e-12), f"{name}: {key} differs by {float(err):.3e}"


def test_a_wrong_scale_or_a_dropped_satellite_is_detected(batches, reference) -> None:
    """Guard for the test itself: losing one satellite's gradients changes the update."""
    ref_weights, ref_norm = reference

    async def lossy() -> float:
        core, sat = await new_cell(0), await new_cell(1)
        start = await core.state_dict()
        for cell in (core, sat):
            await cell.drain()
        await core.to_training(None, 0)
        await sat.to_training(start, 0)
        for i, b in enumerate(batches):
            await (core if i % 2 else sat).train(b)
        await sat.to_rollout(start, 0, discard_grads=True)  # gradients dropped instead of exported
        norm = (await core.optimizer_step(step_scale(batches)))["grad_norm"]
        core.close()
        sat.close()
        return norm

    assert asyncio.run(lossy()) != pytest.approx(ref_norm, rel=1e-3)


def test_satellite_refuses_to_leave_with_unexported_gradients(batches) -> None:
    async def scenario() -> None:
        core, sat = await new_cell(0), await new_cell(1)
        start = await core.state_dict()
        with pytest.raises(RuntimeError, match="drain it"):
            await sat.to_training(start, 0)
        await sat.drain()
        with pytest.raises(ValueError, match="core's weights"):
            await sat.to_training(None, 0)
        await sat.to_training(start, 0)
        for b in batches:
            await sat.train(b)
        with pytest.raises(RuntimeError, match="export them"):
            await sat.to_rollout(start, 0)
        with pytest.raises(RuntimeError, match="core only"):
            await sat.optimizer_step(1.0)
        grads = make_transport("object_store", owner="test").fetch(await sat.export_grads())
        assert any(float(g.abs().sum()) > 0 for g in grads.values())
        await sat.to_rollout(start, 0)
        assert sat.role == "rollout" and sat.engine.stats()["version"] == 0
        core.close()
        sat.close()

    asyncio.run(scenario())


def test_stream_claims_in_order_and_gives_back() -> None:
    stream = MicroBatchStream()
    stream.put("a", ["e1", "e2"])
    stream.put("b", ["e2", "e3"])
    first = stream.claim("cell-1")
    second = stream.claim("cell-0")
    assert (first.ref, second.ref) == ("a", "b") and stream.claim("cell-0") is None
    stream.give_back(second.index)  # cell-0 left before training it
    again = stream.claim("cell-2")
    assert again.ref == "b" and again.claimed_by == "cell-2"
    with pytest.raises(RuntimeError, match="claimed by"):
        stream.trained(again.index, "cell-0")
    stream.trained(first.index, "cell-1")
    stream.trained(again.index, "cell-2")
    assert not stream.complete  # not sealed: another group may still end
    stream.seal()
    assert stream.complete and stream.scale() == pytest.approx(1 / 3)
    assert stream.trained_by_cell() == {"cell-1": 1, "cell-2": 1}
    with pytest.raises(RuntimeError, match="sealed"):
        stream.put("c", ["e4"])


def _second_batches() -> list[MicroBatch]:
    """A later step's micro-batches (other executions; generated by the previous version under eta = 1)."""
    records = {f"f{i}": synthetic_execution(f"f{i}", 90 + i, WORKLOAD)[0] for i in range(4)}
    rewards = {e: float(i % 2) for i, e in enumerate(records)}
    traj = TrajectorySection(row_tokens=64, micro_batch_tokens=64)
    cfg = type("Cfg", (), {"trajectory": traj, "algo": AlgoSection(**ALGO)})()
    return build_training_batches(records, rewards, dict.fromkeys(records, "g"), cfg)


def test_pipelined_updates_equal_the_single_trainer_reference(batches) -> None:
    """Two updates as the scheduler pipelines them: batch 1 arrives (its tokens from version 0) while
    batch 0 trains on core + satellite; after update 0 the satellite loads version 1 (publish) and
    batch 1 trains spread the other way round. Same weights as one trainer doing both updates in order."""
    later = _second_batches()
    trainer = TrainerFactory(MODEL, TRAINER, ALGO)()
    for group in (batches, later):
        for b in group:
            trainer.forward_backward(b)
        trainer.optimizer_step(step_scale(group))
    reference = trainer.state_dict()

    async def pipelined() -> dict[str, torch.Tensor]:
        core, sat = await new_cell(0), await new_cell(1)
        streams = {0: MicroBatchStream(), 1: MicroBatchStream()}
        for b in batches:
            streams[0].put(b, b.meta["execution_ids"])
        streams[0].seal()
        for b in later:  # queued early (prefetched step), trainable only after update 0
            streams[1].put(b, b.meta["execution_ids"])
        streams[1].seal()
        await core.drain()
        await core.to_training(None, 0)
        await sat.drain()
        await sat.to_training(await core.state_dict(), 0)
        for version, (first, second) in enumerate(((core, sat), (sat, core))):
            stream, turn = streams[version], 0
            while (item := stream.claim((first, second)[turn % 2].cell_id)) is not None:
                cell = first if item.claimed_by == first.cell_id else second
                await cell.train(item.ref)
                stream.trained(item.index, cell.cell_id)
                turn += 1
            assert stream.complete and len(stream.trained_by_cell()) == 2
            await core.import_grads(await sat.export_grads())
            metrics = await core.optimizer_step(stream.scale())
            assert metrics["version"] == version + 1
            await sat.load_trainer_weights(await core.state_dict(), version + 1)  # the publish
        weights = await core.state_dict()
        with pytest.raises(RuntimeError, match="owns the weights"):
            await core.load_trainer_weights(weights, 2)
        core.close()
        sat.close()
        return weights

    weights = asyncio.run(pipelined())
    start = TrainerFactory(MODEL, TRAINER, ALGO)().state_dict()
    for key, value in reference.items():
        moved = float((value - start[key]).norm())
        err = float((weights[key] - value).norm())
        assert err <= 1e-6 * max(moved, 1e-12), f"{key} differs by {err:.3e} (moved {moved:.3e})"


def test_gradients_discarded_by_a_restarted_scheduler_never_take_a_late_import(batches) -> None:
    """A dead scheduler's `import_grads` still fetching its satellite's gradients (outside the core's
    lock) used to land after the restarted scheduler's `discard_grads`: the core then held
    micro-batches the new scheduler trains again. `discard_grads` and `settled_version` wait for
    imports under way."""

    async def scenario() -> None:
        core, sat = await new_cell(0), await new_cell(1)
        start = await core.state_dict()
        await sat.drain()
        await sat.to_training(start, 0)
        await sat.train(batches[0])
        ticket = await sat.export_grads()
        fetch = core._grads_tx.fetch

        def slow_fetch(t):  # a large gradient ticket, still arriving
            import time

            time.sleep(0.5)
            return fetch(t)

        core._grads_tx.fetch = slow_fetch
        importing = asyncio.ensure_future(core.import_grads(ticket))
        await asyncio.sleep(0.1)  # the import is fetching, holding no lock
        assert await core.settled_version() == 0 and importing.done()
        await core.discard_grads()
        held = core._trainer().export_grads()
        assert all(float(g.abs().sum()) == 0 for g in held.values())  # nothing landed after the discard
        # and `discard_grads` alone, with no `settled_version` before it, waits for the import too
        await sat.train(batches[0])
        importing = asyncio.ensure_future(core.import_grads(await sat.export_grads()))
        await asyncio.sleep(0.1)
        await core.discard_grads()
        assert importing.done()
        held = core._trainer().export_grads()
        assert all(float(g.abs().sum()) == 0 for g in held.values())
        core.close()
        sat.close()

    asyncio.run(scenario())


def test_two_publishes_of_one_version_stage_it_once(batches) -> None:
    """A restarted scheduler may ask the core to publish while the dead one's publish of the same
    version is still staging: both passed the "already published" check and the version was
    staged twice (releasing the one before it early), or the second raised "published after"."""

    async def scenario() -> None:
        core = await new_cell(0)
        publish = core._publisher.publish

        def slow_publish(state, version):
            import time

            time.sleep(0.3)
            return publish(state, version)

        core._publisher.publish = slow_publish
        first, second = await asyncio.gather(core.publish_weights(), core.publish_weights())
        assert first is second and [t.version for t in core._publisher._live] == [0]
        core.close()

    asyncio.run(scenario())
