"""The transfer seam: payload layout, and every backend moving weights, gradients and KV state between
Ray actors bit-for-bit; failures name the cell and the version and leave the old weights in place."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from longtail_workload import register_by_value

from gyre_ray.engines.base import KVState, SamplingParams
from gyre_ray.engines.testing import small_model
from gyre_ray.runtime.cluster import start_local_ray
from gyre_ray.transfer import TransferError, make_transport
from gyre_ray.transfer.collective import CollectiveHost
from gyre_ray.transfer.config import TransferSection
from gyre_ray.transfer.layout import checksums, plan, read_from, tensor_checksums, write_into
from gyre_ray.transfer.mooncake import mooncake_available
from gyre_ray.transfer.weights import WeightPublisher, WeightReceiver

MOONCAKE_OK, MOONCAKE_WHY = mooncake_available()
needs_mooncake = pytest.mark.skipif(
    not MOONCAKE_OK and os.environ.get("CI") != "true", reason=f"Mooncake cannot load here: {MOONCAKE_WHY}"
)
BACKENDS = ["object_store", pytest.param("mooncake", marks=needs_mooncake), "collective"]


def _payload() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "ids": torch.arange(11, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
        "kv": _kv_state("r1", layers=1),
        "meta": {"step": 3, "names": ["a", "b"]},
    }


def _kv_state(rid: str, layers: int) -> KVState:
    g = torch.Generator().manual_seed(1)
    kv = [(torch.randn(2, 8, 4, generator=g), torch.randn(2, 8, 4, generator=g)) for _ in range(layers)]
    return KVState(rid, [1, 2, 3, 4, 5, 6, 7, 8], [9], [-0.5], [0], SamplingParams(temperature=0.0), kv)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, KVState):  # every field: the outputs, log-probs, versions and RNG state move too
        return type(b) is KVState and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(KVState)
        )
    return a == b


def test_layout_round_trip_is_bit_exact() -> None:
    payload = _payload()
    layout, tensors = plan(payload)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    write_into(buffer, layout, tensors)
    assert all(s.offset % 64 == 0 for s in layout.specs)
    assert checksums(buffer, layout) == tensor_checksums(tensors)
    assert _same(read_from(buffer, layout), payload)


class _Peer:
    """One process' end of a transport, as a cell actor would hold it."""

    def __init__(self, backend: str, owner: str, timeout_s: float = 120.0) -> None:
        section = TransferSection(verify_checksums=True, timeout_s=timeout_s)
        self.transport = make_transport(backend, section, owner=owner)
        self.receivers: dict[str, WeightReceiver] = {}
        self.got: dict[str, Any] = {}
        self.publisher = WeightPublisher(self.transport)

    def connect(self, name: str, peers: list[str]) -> None:
        self.transport.connect(name, None, peers)

    def stats(self) -> dict[str, Any]:
        return self.transport.stats

    def stage(self, payload: Any, kind: str, version: int | None = None, **options: Any) -> Any:
        return self.transport.stage(payload, kind=kind, version=version, **options)

    def publish(self, state: dict, version: int) -> Any:
        return self.publisher.publish(state, version)

    def push(self, ticket: Any) -> Any:
        return self.transport.push(ticket)

    def fetch(self, ticket: Any) -> Any:
        return self.transport.fetch(ticket)

    def reuse_probe(self, tickets: list[Any]) -> dict[str, Any]:
        """Fetch tickets[0] and keep it, fetch [1] and drop it, fetch [2]: which receive buffers held them."""
        kept = self.transport.fetch(tickets[0])
        second = self.transport.fetch(tickets[1])
        second_ptr, second_values = second["x"].data_ptr(), second["x"].tolist()
        del second
        third = self.transport.fetch(tickets[2])
        return {
            "kept": kept["x"].tolist(), "second": second_values, "third": third["x"].tolist(),
            "kept_ptr": kept["x"].data_ptr(), "second_ptr": second_ptr, "third_ptr": third["x"].data_ptr(),
        }  # fmt: skip

    def fetch_at_once(self, tickets: list[Any], trials: int, fresh_pool: bool) -> list[list[float]]:
        """Fetch `tickets` in one thread each, started together, `trials` times (each on a new
        transport with an empty receive pool when `fresh_pool`; checksums off, as a run has them);
        returns, per trial and ticket, the distinct values that arrived."""
        seen = []
        for _ in range(trials):
            transport = self.transport
            if fresh_pool:
                transport = make_transport(self.transport.name, TransferSection(), owner=self.transport.owner)
            start = threading.Barrier(len(tickets))
            got: list[Any] = [None] * len(tickets)

            def fetch(i: int, transport: Any = transport, start: Any = start, got: list = got) -> None:
                start.wait()
                got[i] = transport.fetch(tickets[i])["x"].unique().tolist()

            threads = [threading.Thread(target=fetch, args=(i,)) for i in range(len(tickets))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            seen.append(got)
        return seen

    def receive_weights(self, ticket: Any, engine: str = "main") -> int:
        """Load `ticket` into the named (stand-in) engine, through that engine's WeightReceiver."""
        receiver = self.receivers.setdefault(engine, WeightReceiver(self.transport))
        return receiver.receive(ticket, lambda state, version: self.got.__setitem__(engine, state))

    def held(self, engine: str = "main") -> tuple[int | None, Any]:
        receiver = self.receivers.get(engine)
        return (receiver.version if receiver else None), self.got.get(engine)


Peer = ray.remote(_Peer)


@ray.remote
class CollectivePeer(_Peer, CollectiveHost):
    """A peer whose transport is the collectives backend: it also answers its peers' calls."""

    def _collective(self) -> Any:
        return self.transport


def _collective_peers(names: list[str], **options: Any) -> list[Any]:
    """Named collective peers that know each other (the first one is the core)."""
    peers = [CollectivePeer.options(name=n, num_cpus=0).remote("collective", n, **options) for n in names]
    ray.get([p.connect.remote(n, names) for p, n in zip(peers, names, strict=True)])
    return peers


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's INFO lines
    register_by_value(__name__)  # the peers' classes (tests/ is not importable in Ray workers)
    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


_PEERS: dict[str, list[Any]] = {}


def _peers(backend: str) -> list[Any]:
    """Three peers per backend (cell-0 the core), started once for the module (actors start slowly)."""
    if backend not in _PEERS:
        if backend == "collective":
            peers = _collective_peers([f"cell-{i}" for i in range(3)])
        else:
            peers = [Peer.options(num_cpus=0).remote(backend, f"cell-{i}") for i in range(3)]
        _PEERS[backend] = peers
    return _PEERS[backend]


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_arrive_bit_for_bit_on_every_cell(backend: str) -> None:
    state = small_model(3).state_dict()
    core, *cells = _peers(backend)
    for version in (1, 2):
        state = {k: v + version for k, v in state.items()}
        ticket = ray.get(core.publish.remote(state, version))
        assert ticket.checksums == tensor_checksums(list(state.values()))
        pushed = ray.get(core.push.remote(ticket))  # collectives: the broadcast; a no-op for the others
        if backend == "collective":
            assert sorted(pushed["received"]) == ["cell-1", "cell-2"] and not pushed["missed"]
        assert ray.get([c.receive_weights.remote(ticket) for c in cells]) == [version] * len(cells)
        for cell in cells:
            held_version, got = ray.get(cell.held.remote())
            assert held_version == version and _same(got, state)
    if backend == "collective":  # every fetch was the broadcast's bytes, none went the fallback way
        assert [ray.get(c.stats.remote())["fallback"] for c in cells] == [0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_from_satellites_sum_on_the_core(backend: str) -> None:
    core, *satellites = _peers(backend)
    grads = [{"a": torch.randn(4, 4), "b": torch.randn(9)} for _ in satellites]
    tickets = ray.get(
        [s.stage.remote(g, "grads", 0, dst_rank=0) for s, g in zip(satellites, grads, strict=True)]
    )
    total = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    for sat, ticket in zip(satellites, tickets, strict=True):
        fetched, _ = ray.get([core.fetch.remote(ticket), sat.push.remote(ticket)])
        for k in total:
            total[k] += fetched[k]
    for k in total:
        assert torch.equal(total[k], grads[0][k] + grads[1][k])
    if backend == "collective":  # both pulled point to point, no fallback
        stats = ray.get(core.stats.remote())
        assert stats["collective"] >= 2 and stats["fallback"] == 0


def _own_dist_group(self: Any) -> bool:
    """Run inside an actor: give its process a torch.distributed group of its own (as Megatron would)."""
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, world_size=1, rank=0)
    return dist.is_initialized()


def test_collective_groups_follow_membership_and_a_missed_broadcast_falls_back_to_the_object_store() -> None:
    names = ["m-0", "m-1", "m-2", "m-3"]
    core, cell, gone, busy = _collective_peers(names)
    assert ray.get(busy.__ray_call__.remote(_own_dist_group))  # cannot join: its process has a group
    _kill_and_wait(gone)  # dead before version 1 is published
    state = {"w": torch.randn(64, 64), "step": torch.tensor(1)}
    ticket = ray.get(core.publish.remote(state, 1))
    pushed = ray.get(core.push.remote(ticket))
    assert pushed["received"] == ["m-1"] and set(pushed["missed"]) == {"m-2", "m-3"}
    assert "no such actor" in pushed["missed"]["m-2"] and "cannot join" in pushed["missed"]["m-3"]
    assert ray.get(cell.receive_weights.remote(ticket)) == 1
    assert ray.get(cell.stats.remote())["fallback"] == 0
    # m-2 restarted (a new process under the same name): it missed the broadcast, so it fetches v1
    # through the object store, bit for bit; so does the cell that could not join
    (restarted,) = (CollectivePeer.options(name="m-2", num_cpus=0).remote("collective", "m-2"),)
    ray.get(restarted.connect.remote("m-2", names))
    for late in (restarted, busy):
        assert ray.get(late.receive_weights.remote(ticket)) == 1
        assert _same(ray.get(late.held.remote())[1], state)
        stats = ray.get(late.stats.remote())
        assert stats["fallback"] == 1 and stats["last_fallback"]["reason"] == "not received by broadcast"
    # the next version's group has the restarted cell in it again
    ticket = ray.get(core.publish.remote({k: v * 2 for k, v in state.items()}, 2))
    assert sorted(ray.get(core.push.remote(ticket))["received"]) == ["m-1", "m-2"]
    assert ray.get(restarted.receive_weights.remote(ticket)) == 2
    assert ray.get(restarted.stats.remote())["fallback"] == 1
    for actor in (core, cell, restarted, busy):
        ray.kill(actor)


def test_gradients_from_a_satellite_that_cannot_join_come_through_the_object_store_at_once() -> None:
    """A satellite whose process holds a torch.distributed group of its own (an in-process Megatron
    trainer) answers `collective_ready` with false: the core fetches its gradients through the
    object store at once. It used to start the point-to-point transfer anyway and wait out the
    rendezvous (`transfer.timeout_s`) before falling back."""
    names = ["g-0", "g-1"]
    core, satellite = _collective_peers(names, timeout_s=30.0)
    assert ray.get(satellite.__ray_call__.remote(_own_dist_group))
    grads = {"a": torch.randn(8, 8), "b": torch.randn(5)}
    ticket = ray.get(satellite.stage.remote(grads, "grads", 0, dst_rank=0))
    started = time.monotonic()
    fetched = ray.get(core.fetch.remote(ticket), timeout=120)
    took = time.monotonic() - started
    assert _same(fetched, grads)
    stats = ray.get(core.stats.remote())
    assert stats["fallback"] == 1 and stats["collective"] == 0
    assert stats["last_fallback"]["reason"].startswith("g-1 cannot join"), stats["last_fallback"]
    assert took < 15.0, took  # not the 30 s rendezvous timeout
    # the satellite no longer keeps the staged gradients (nothing else would release them: a
    # gradient-sized buffer a step, for good)
    assert ray.get(satellite.__ray_call__.remote(lambda peer: len(peer.transport._staged))) == 0
    for actor in (core, satellite):
        ray.kill(actor)


@pytest.mark.parametrize("backend", ["object_store", pytest.param("mooncake", marks=needs_mooncake)])
def test_kv_state_moves_between_cells(backend: str) -> None:
    _, a, b = _peers(backend)
    state = _kv_state("req-7", layers=3)
    ticket = ray.get(a.stage.remote(state, "kv"))
    assert _same(ray.get(b.fetch.remote(ticket)), state)


@needs_mooncake
def test_mooncake_refuses_a_ticket_whose_buffer_was_reused() -> None:
    core, cell, _ = _peers("mooncake")
    tickets = [ray.get(core.stage.remote({"x": torch.full((4,), float(i))}, "weights")) for i in range(3)]
    assert ray.get(cell.fetch.remote(tickets[2]))["x"].tolist() == [2.0] * 4
    with pytest.raises(ray.exceptions.RayTaskError, match="ticket too old"):
        ray.get(cell.fetch.remote(tickets[0]))  # two staging buffers: the third stage reused the first's


@pytest.mark.parametrize("backend", ["object_store", pytest.param("mooncake", marks=needs_mooncake)])
def test_a_receive_buffer_is_reused_only_once_nothing_views_it(backend: str) -> None:
    core = _peers(backend)[0]
    cell = Peer.options(num_cpus=0).remote(backend, "cell-6")  # its receive pool is empty
    first, second = (
        ray.get(core.stage.remote({"x": torch.full((1000,), float(i))}, "weights", i)) for i in (1, 2)
    )
    probe = ray.get(cell.reuse_probe.remote([first, second, first]))
    assert (
        probe["kept"] == [1.0] * 1000 and probe["second"] == [2.0] * 1000 and probe["third"] == [1.0] * 1000
    )
    assert probe["second_ptr"] != probe["kept_ptr"]  # the first fetch's tensors are alive: another buffer
    assert probe["third_ptr"] == probe["second_ptr"]  # the second's were dropped: its buffer is reused
    ray.kill(cell)


@pytest.mark.parametrize(
    ("backend", "fresh_pool"), [("object_store", True), pytest.param("mooncake", False, marks=needs_mooncake)]
)
def test_fetches_at_once_never_share_a_receive_buffer(backend: str, fresh_pool: bool) -> None:
    """The core imports two satellites' gradients in two threads at once: each must get its own bytes
    (two threads once both took the same idle buffer and one read the other's, checksums off)."""
    core = _peers(backend)[0]
    cell = Peer.options(num_cpus=0).remote(backend, "cell-7")
    payloads = [{"x": torch.full((1 << 20,), float(i + 1), dtype=torch.float64)} for i in range(2)]
    tickets = [ray.get(core.stage.remote(p, "grads", 0)) for p in payloads]
    seen = ray.get(cell.fetch_at_once.remote(tickets, 40, fresh_pool), timeout=300)
    assert seen == [[[1.0], [2.0]]] * 40, [trial for trial in seen if trial != [[1.0], [2.0]]][:3]
    ray.kill(cell)


def _kill_and_wait(actor: Any, timeout_s: float = 120.0) -> None:
    """Kill `actor` and return once its process is gone (Ray reports it dead while it still exits)."""
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            raise AssertionError(f"the killed actor's process {pid} is still there")
        time.sleep(0.1)


@needs_mooncake
def test_failed_transfer_names_cell_and_version_and_keeps_old_weights() -> None:
    _, _, cell = _peers("mooncake")
    sender = Peer.options(num_cpus=0).remote("mooncake", "cell-9")
    state = small_model(1).state_dict()
    ray.get(cell.receive_weights.remote(ray.get(sender.publish.remote(state, 1)), "failing"))
    ticket = ray.get(sender.publish.remote({k: v * 2 for k, v in state.items()}, 2))
    _kill_and_wait(sender)  # the sender is gone before the cell reads version 2
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(cell.receive_weights.remote(ticket, "failing"))
    assert isinstance(info.value.cause, TransferError)
    message = str(info.value.cause)
    assert "cell-2" in message and "weights v2" in message and "cell-9" in message
    held_version, got = ray.get(cell.held.remote("failing"))
    assert held_version == 1 and _same(got, state)


def _wait_stopped(pid: int, within_s: float = 10.0) -> None:
    """Until every thread of `pid` is stopped: a stop takes effect as each thread is next scheduled,
    which on a loaded machine (late in a full CI run) can come after the read it should block."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                states.append(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        if all(state in "tT" for state in states):
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} did not stop within {within_s:g} s")


@needs_mooncake
def test_a_mooncake_read_from_a_stuck_sender_times_out_naming_cell_and_version() -> None:
    sender = Peer.options(num_cpus=0).remote("mooncake", "cell-8")
    cell = Peer.options(num_cpus=0).remote("mooncake", "cell-7", timeout_s=2.0)
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    assert ray.get(cell.receive_weights.remote(ray.get(sender.publish.remote(state, 1)))) == 1
    ticket = ray.get(sender.publish.remote({"w": state["w"] * 2}, 2))
    pid = ray.get(sender.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)  # alive but silent: its reads hang
    try:
        _wait_stopped(pid)
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(cell.receive_weights.remote(ticket), timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert isinstance(info.value.cause, TransferError)
    message = str(info.value.cause)
    assert message.startswith("cell-7: receiving weights v2 from cell-8") and "within 2 s" in message
    held_version, got = ray.get(cell.held.remote())
    assert held_version == 1 and _same(got, state)
    assert ray.get(cell.receive_weights.remote(ticket)) == 2  # the sender is back: the next try works
    ray.kill(sender)
    ray.kill(cell)


@ray.remote(num_cpus=0)
def _never() -> None:
    time.sleep(3600)


def test_object_store_timeout_is_a_clear_error_and_keeps_old_weights() -> None:
    """On one node plasma outlives a dead sender, so the object store's failure here is a timeout."""
    transport = make_transport("object_store", TransferSection(timeout_s=0.5), owner="cell-4")
    receiver = WeightReceiver(transport)
    held: list[int] = []
    receiver.receive(WeightPublisher(transport).publish({"w": torch.ones(3)}, 1), lambda s, v: held.append(v))
    stuck = _never.remote()
    good = transport.stage({"w": torch.zeros(3)}, kind="weights", version=2)
    ticket = dataclasses.replace(good, address={"ref": [stuck]})
    with pytest.raises(
        TransferError, match=r"cell-4: receiving weights v2 from cell-4 .* no data within 0.5 s"
    ):
        receiver.receive(ticket, lambda s, v: held.append(v))
    assert receiver.version == 1 and held == [1]
    ray.cancel(stuck, force=True)


def test_receiver_never_goes_back_a_version() -> None:
    transport = make_transport("object_store", owner="cell-1")
    loads: list[int] = []
    receiver = WeightReceiver(transport)
    publisher = WeightPublisher(transport)
    t1 = publisher.publish({"w": torch.ones(2)}, 1)
    t2 = publisher.publish({"w": torch.ones(2) * 2}, 2)
    assert receiver.receive(t2, lambda s, v: loads.append(v)) == 2
    assert receiver.receive(t1, lambda s, v: loads.append(v)) == 2
    assert loads == [2]
    with pytest.raises(ValueError, match="only move forward"):
        publisher.publish({"w": torch.ones(2)}, 2)
