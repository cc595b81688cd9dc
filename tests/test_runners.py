"""Runner actors (`gyre_ray.runtime.runners`, `agents.runners`): which runner takes an execution, the
proxy URL runners on other nodes call, the config's checks, and the journal that remembers each
execution's runner for a restarted scheduler. The multi-node run is `test_runners_nodes.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre_ray.agents.relaunch import planned_id, relaunch_id, starts_of
from gyre_ray.config import ConfigError, load_config
from gyre_ray.runtime.journal import RunJournal
from gyre_ray.runtime.runners import (
    EXECUTOR_BACK_WITHIN_S,
    MAX_STARTS,
    ExecutorLostError,
    RunnerRecovery,
    executor_name,
    least_loaded,
    runner_base_url,
    runner_name,
)


def test_an_execution_goes_to_the_runner_running_the_fewest() -> None:
    assert least_loaded([], 3) == 0
    assert least_loaded([0, 0, 1], 3) == 2
    assert least_loaded([0, 1, 2, 2, 0], 3) == 1
    running: list[int] = []
    for _ in range(7):  # one at a time, none ending: dealt out evenly
        running.append(least_loaded(running, 3))
    assert sorted(running) == [0, 0, 0, 1, 1, 2, 2]


def test_runners_beside_the_proxy_call_its_own_url() -> None:
    url = "http://127.0.0.1:8000"
    assert runner_base_url(url, "127.0.0.1", "10.0.0.5", ["10.0.0.5", "10.0.0.5"]) == url


def test_runners_elsewhere_call_the_proxys_node_address() -> None:
    got = runner_base_url("http://127.0.0.1:8123", "0.0.0.0", "10.0.0.5", ["10.0.0.5", "10.0.0.7"])
    assert got == "http://10.0.0.5:8123"
    assert runner_base_url("http://127.0.0.1:8123", "::", "fd00::5", ["fd00::6"]) == "http://[fd00::5]:8123"
    routable = "http://10.0.0.5:8123"  # the proxy bound to an address of its own: reachable as it is
    assert runner_base_url(routable, "10.0.0.5", "10.0.0.5", ["10.0.0.7"]) == routable


def test_a_proxy_on_loopback_refuses_runners_on_other_nodes() -> None:
    with pytest.raises(
        ConfigError, match=r"runner-1 run on other nodes than the proxy \(10.0.0.5\).*proxy.host=0.0.0.0"
    ):
        runner_base_url("http://127.0.0.1:8000", "127.0.0.1", "10.0.0.5", ["10.0.0.5", "10.0.0.7"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["agents.runners=-1"], "agents.runners: Input should be greater than or equal to 0"),
        (["agents.runners=2", "agents.runner_resources={agents: 0}"], "the amount must be > 0, got 0.0"),
        (["agents.runners=2", "agents.runner_resources={agents: .nan}"], "Input should be a finite number"),
        (["agents.runner_resources={agents: 1}"], "agents.runners is 0"),
    ],
)
def test_runner_settings_are_checked(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("jobs/configs/toy.yaml", overrides)


def test_the_journal_remembers_each_executions_runner_and_its_relaunches(tmp_path) -> None:
    header = {"steps": 1}
    journal = RunJournal.begin(tmp_path, header, 0)
    journal.launched(0, 1, at_s=0.5, execution_id="s0-a-0", group="s0-a", step=0, version=0, runner=1)
    journal.launched(1, 0, at_s=0.6, execution_id="s0-a-1", group="s0-a", step=0, version=0)  # `workers`
    loss = {"runner": 1, "execution": "s0-a-0", "relaunched_as": "r1.s0-a-0", "on_runner": 0, "at_s": 2.5}
    journal.runner_lost(loss)
    journal.launched(0, 1, at_s=0.5, execution_id="r1.s0-a-0", group="s0-a", step=0, version=0, runner=0)
    state = RunJournal.replay(tmp_path, header)
    assert state is not None and state.launched == {0: 1, 1: 0}
    assert state.runners == {0: 0}  # its last launch's
    assert state.launches[0]["execution_id"] == "r1.s0-a-0"
    assert state.runner_losses == [loss]  # a restarted scheduler's result lists it
    assert runner_name(1) == "runner-1"


def test_a_dead_runner_is_avoided_while_another_is_left() -> None:
    assert least_loaded([0, 0, 2], 3, avoid={1}) == 2
    assert least_loaded([], 2, avoid={0, 1}) == 0  # all dead: Ray may be restarting them


def test_an_execution_started_again_gets_a_new_id() -> None:
    assert relaunch_id("s0-vowels-3") == "r1.s0-vowels-3"
    assert relaunch_id("r1.s0-vowels-3") == "r2.s0-vowels-3"
    assert relaunch_id("elastic.s0-lt00-vowels-1") == "r1.elastic.s0-lt00-vowels-1"
    from gyre_ray.envs.longtail import execution_seconds, schedule_for

    schedule = schedule_for()  # the same duration: it is read from the id's last part
    assert execution_seconds(schedule, "r1.s0-lt00-vowels-1") == execution_seconds(
        schedule, "s0-lt00-vowels-1"
    )


def test_an_executions_starts_are_read_from_its_id_and_bounded() -> None:
    assert [starts_of(i) for i in ("s0-a-0", "r1.s0-a-0", "r4.elastic.s0-a-0", "elastic.s0-a-0")] == [
        1,
        2,
        5,
        1,
    ]
    assert executor_name(None) == "workers" and executor_name(2) == "runner-2"
    assert [planned_id(i) for i in ("s0-a-0", "r1.s0-a-0", "r12.elastic.s0-a-0")] == [
        "s0-a-0",
        "s0-a-0",
        "elastic.s0-a-0",
    ]

    class Scheduler(RunnerRecovery):  # only what `_runner_lost` reads before it refuses
        task = type("Task", (), {"task_id": "a"})()
        planned = [type("Item", (), {"execution_id": f"r{MAX_STARTS - 1}.s0-a-0", "task": task})()]
        store = None
        lost_runners: set[int | None] = set()

    run = type("Run", (), {"exec_id": 0, "runner": None})()
    with pytest.raises(
        ExecutorLostError, match=rf"r{MAX_STARTS - 1}.s0-a-0 lost its executor \(workers\) {MAX_STARTS} times"
    ):
        Scheduler()._runner_lost(run)


def test_workspaces_go_under_the_run_folder_or_a_node_local_root(tmp_path) -> None:
    cfg = load_config("jobs/configs/toy.yaml")
    assert cfg.agents.workspaces_dir("/runs/toy-1") == Path("/runs/toy-1/workspaces")
    local = load_config("jobs/configs/toy.yaml", ["agents.workspace_root=/var/lib/gyre"])
    assert local.agents.workspaces_dir("/runs/toy-1") == Path("/var/lib/gyre/toy-1/workspaces")
    with pytest.raises(ConfigError, match="agents.workspace_root: .*must be an absolute path"):
        load_config("jobs/configs/toy.yaml", ["agents.workspace_root=scratch/ws"])


def test_a_dead_runner_takes_executions_again_once_it_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """`lost_runners` is a while, not the rest of the run: a probe every second brings it back."""
    import time
    from types import SimpleNamespace

    import ray
    from ray.exceptions import ActorUnavailableError

    from gyre_ray.runtime import runners as runners_module

    answers: dict[str, object] = {}
    monkeypatch.setattr(ray, "get", lambda ref, **_: _raise_or(answers[ref]))
    asked: list[int] = []

    def runner(index: int) -> SimpleNamespace:
        def remote() -> str:
            asked.append(index)
            return f"probe-{index}-{len(asked)}"

        return SimpleNamespace(node_ip=SimpleNamespace(remote=remote))

    sched = runners_module.RunnerRecovery()
    sched.runners, sched.lost_runners = [runner(0), runner(1)], {1}
    sched.runner_probes, sched.runner_probe_due, sched.lost_at = {}, {}, {}
    sched.waiting_starts, sched.waiting_groups = [], []
    sched._probe_lost_runners()
    sched._probe_lost_runners()  # one probe in flight at a time
    (ref,) = sched.runner_probes
    assert asked == [1]
    answers[ref] = ActorUnavailableError("restarting", None)
    sched._runner_probed(ref, sched.runner_probes.pop(ref))
    assert sched.lost_runners == {1}
    sched._probe_lost_runners()
    assert asked == [1] and not sched.runner_probes  # not before RUNNER_PROBE_EVERY_S
    sched.runner_probe_due[1] = time.monotonic() - 1.0
    sched._probe_lost_runners()
    (ref,) = sched.runner_probes
    answers[ref] = "10.0.0.2"
    sched._runner_probed(ref, sched.runner_probes.pop(ref))
    assert sched.lost_runners == set() and least_loaded([0, 0], 2, sched.lost_runners) == 1


def _raise_or(value: object) -> object:
    if isinstance(value, BaseException):
        raise value
    return value


def test_starting_again_skips_an_id_a_dead_scheduler_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler that died between registering `r1.<id>` and journaling its launch left that id
    registered: the next start takes `r2.<id>` (revoking `r1.<id>`'s key) instead of failing the run."""
    from types import SimpleNamespace

    import ray

    from gyre_ray.runtime.runners import register_again

    registered = {"r1.s0-t-0"}
    finished: list[str] = []

    def register(execution_id: str, metadata: dict) -> object:
        if execution_id in registered:
            return RuntimeError(f"execution {execution_id!r} is already registered")
        registered.add(execution_id)
        return {"api_key": f"gyre-{execution_id}", "metadata": metadata}

    monkeypatch.setattr(ray, "get", lambda value, **_: _raise_or(value))
    store = SimpleNamespace(
        register=SimpleNamespace(remote=register),
        finish_execution=SimpleNamespace(remote=finished.append),
    )
    assert register_again(store, "s0-t-0", {"task_id": "t"}, "runner-0") == ("r2.s0-t-0", "gyre-r2.s0-t-0")
    assert finished == ["s0-t-0", "r1.s0-t-0"]
    registered.update({"r3.x", "r4.x"})
    with pytest.raises(RuntimeError, match="already registered"):  # bounded as any start is
        register_again(store, "r2.x", {"task_id": "t"}, "runner-0")


def test_a_start_with_no_executor_answering_waits_without_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """`workers` (no runners) died under two executions: each is registered again at once, waits
    while Ray starts `workers` again (a call then would fail and cost it a start), and both start,
    journaled, once a probe is answered; nothing in between blocks the scheduler loop."""
    import time
    from types import SimpleNamespace

    import ray
    from ray.exceptions import ActorUnavailableError

    from gyre_ray.agents.launch import PlannedExecution
    from gyre_ray.runtime import runners as runners_module

    answers: dict[str, object] = {}
    monkeypatch.setattr(ray, "get", lambda ref, **_: _raise_or(answers[ref]))
    monkeypatch.setattr(
        runners_module, "register_again", lambda _s, eid, _m, _n: (relaunch_id(eid), "k-" + eid)
    )
    probes: list[str] = []
    workers = SimpleNamespace(
        node_ip=SimpleNamespace(remote=lambda: probes.append("p") or f"probe-{len(probes)}")
    )
    started, launched, losses = [], [], []

    class Scheduler(RunnerRecovery):
        def __init__(self) -> None:
            task = SimpleNamespace(task_id="t")
            self.planned = [PlannedExecution(f"s0-t-{i}", task, "s0-t") for i in (0, 1)]
            self.store, self.runners, self.running, self.workers = None, [], {}, workers
            self.lost_runners, self.runner_probes, self.runner_probe_due, self.lost_at = set(), {}, {}, {}
            self.waiting_starts, self.waiting_groups = [], []
            self.runner_losses = losses
            self.journal = SimpleNamespace(
                runner_lost=lambda _: None, launched=lambda *a, **kw: launched.append(kw)
            )
            self.recorder = SimpleNamespace(ran_on=lambda *_: None)
            self.ledger = SimpleNamespace(batch_of=[0, 0])

        def _now(self) -> float:
            return 3.0

        def _pick_runner(self) -> None:
            return None  # no runners: `workers`

        def _start_execution(self, item: SimpleNamespace, key: str, runner: int | None) -> tuple[str, None]:
            started.append((item.execution_id, key))
            return f"ref-{item.execution_id}", runner

    sched = Scheduler()
    runs = [SimpleNamespace(exec_id=i, runner=None, cell=0, since=1.0, version=0) for i in (0, 1)]
    for run in runs:
        sched._runner_lost(run)
    assert started == [] and launched == [] and sched.lost_runners == {None}
    assert [(loss["relaunched_as"], loss["on_runner"]) for loss in losses] == [
        ("r1.s0-t-0", "waiting"),
        ("r1.s0-t-1", "waiting"),
    ]
    sched._probe_lost_runners()
    (ref,) = sched.runner_probes
    answers[ref] = ActorUnavailableError("restarting", None)
    sched._runner_probed(ref, sched.runner_probes.pop(ref))
    assert started == [] and len(sched.waiting_starts) == 2  # still down: asked again later
    sched.runner_probe_due[None] = time.monotonic() - 1.0
    sched.lost_at[None] -= EXECUTOR_BACK_WITHIN_S + 1.0  # down for longer than it may be: the run stops
    with pytest.raises(ExecutorLostError, match=r"workers did not come back within 300 s"):
        sched._probe_lost_runners()
    sched.lost_at[None] += EXECUTOR_BACK_WITHIN_S
    sched._probe_lost_runners()
    (ref,) = sched.runner_probes
    answers[ref] = "10.0.0.1"
    sched._runner_probed(ref, sched.runner_probes.pop(ref))
    assert started == [("r1.s0-t-0", "k-s0-t-0"), ("r1.s0-t-1", "k-s0-t-1")]
    assert sorted(sched.running) == ["ref-r1.s0-t-0", "ref-r1.s0-t-1"] and not sched.waiting_starts
    assert [(j["execution_id"], j["runner"]) for j in launched] == [("r1.s0-t-0", None), ("r1.s0-t-1", None)]
    assert sched.lost_at == {}
