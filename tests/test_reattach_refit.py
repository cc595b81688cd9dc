"""A restarted scheduler with `elastic_duration_prior: auto` fits the journaled durations again at once.

The dead actor's policy held a fit of the ended executions (made at each step's end); the new actor
starts from the section's policy, which launches in id order until it has a fit. `_reattach` refits
from the executions the journal says ended, so the sibling order holds across the restart. The
Ray-facing parts of the reattach (cells, workers, the store) are stood in for here; the
fault tests (`test_faults_control.py`) run the whole of it on live actors.
"""

from __future__ import annotations

from types import SimpleNamespace

import ray  # noqa: F401 (a Ray test module: fails, not skips, without Ray)

from gyre_ray.config import GyreConfig
from gyre_ray.runtime.journal import JournalState
from gyre_ray.runtime.recorder import RunRecorder
from gyre_ray.runtime.scheduler import RunScheduler
from gyre_ray.scheduling.runtime import ExecutionLedger, policy_from_section

# two tasks of three executions each, in step 0; step 1's six not launched yet
DURATIONS_S = [100.0, 150.0, 120.0, 900.0, 1500.0, 5400.0]


def restarted_scheduler(duration_prior: object, published: int) -> RunScheduler:
    """A `RunScheduler` as `run` leaves it just before `_reattach`, with the Ray-facing steps stood in for."""
    cfg = GyreConfig.model_validate({
        "scheduler": {"policy": "elastic", "staleness": 1, "elastic_launch_order": "sibling",
                      "elastic_duration_prior": duration_prior},
    })  # fmt: skip
    sched = RunScheduler.__new__(RunScheduler)
    sched.cfg = cfg
    sched.views = [SimpleNamespace(), SimpleNamespace()]
    sched.policy = policy_from_section(cfg.scheduler, len(sched.views))
    sched.step_metrics, sched.faults, sched.groups = [], [], {}
    sched.runner_losses, sched.lost_runners = [], set()
    sched.recorder = RunRecorder(["cell-0", "cell-1"])
    sched.first_step, sched.steps, sched.trainer_version = 0, 2, published
    sched.scheduler_restarts = []
    sched.journal = SimpleNamespace(published=lambda *args: None)
    sched.ledger = ExecutionLedger.planned([0] * 6 + [1] * 6, [0, 0, 0, 1, 1, 1] + [2, 2, 2, 3, 3, 3])
    sched._reset_cells = lambda: 0

    def rebook(state: JournalState) -> dict[str, int]:
        for e in state.outcomes:
            sched.ledger.launch(e, 0, now=0.0)
            sched.ledger.end(e, ran_s=DURATIONS_S[e], timed_out=DURATIONS_S[e] >= 5400.0)
        return {"ended": len(state.outcomes), "running": 0}

    sched._rebook = rebook
    return sched


def journal(published: int) -> JournalState:
    return JournalState(
        header={"steps": 2, "first_step": 0, "tag": ""},
        launched={e: 0 for e in range(6)},
        outcomes={e: {} for e in range(6)},
        published=[{"batch": b, "version": b + 1, "metrics": {"step": b}} for b in range(published)],
    )


def test_a_restarted_scheduler_refits_an_auto_prior_from_the_journal() -> None:
    sched = restarted_scheduler("auto", published=1)
    assert sched.policy.launch_order == "fifo"  # the section's policy: no fit yet
    sched._reattach(journal(published=1))
    assert sched.policy.launch_order == "sibling"
    model = sched.scheduler_restarts[-1]["duration_model"]
    assert (model["executions"], model["tasks"], model["timed_out"]) == (6, 2, 1)


def test_no_refit_before_the_first_step_ends_nor_for_a_configured_prior() -> None:
    early = restarted_scheduler("auto", published=0)
    early._reattach(journal(published=0))  # the dead actor had not fitted either
    assert early.policy.launch_order == "fifo" and "duration_model" not in early.scheduler_restarts[-1]
    prior = {"mu_log_hours": -0.916, "sigma_log_hours": 0.55, "rho": 0.6, "timeout_hours": 1.5}
    configured = restarted_scheduler(prior, published=1)
    before = configured.policy
    configured._reattach(journal(published=1))
    assert configured.policy is before and "duration_model" not in configured.scheduler_restarts[-1]


def test_the_row_of_an_update_the_dead_scheduler_did_not_journal_carries_its_version() -> None:
    # the core stepped to version 2, but only version 1 was journaled: the restarted scheduler books
    # step 1 as recovered, with the version the driver reads from every row (it raised KeyError)
    sched = restarted_scheduler("auto", published=1)
    sched.trainer_version = 2
    sched._reattach(journal(published=1))
    row = sched.step_metrics[-1]
    assert row["recovered_after_scheduler_restart"] and (row["step"], row["version"]) == (1, 2)


def test_a_restarted_actor_without_this_runs_journal_journals_a_cell_its_reset_finds_dead(
    tmp_path, monkeypatch
) -> None:
    """The reset of the cells ran before the journal existed: a dead cell found there (journaled as a
    fault) raised AttributeError, or wrote into the previous run's closed journal."""
    from gyre_ray.runtime import reattach
    from gyre_ray.runtime.journal import RunJournal
    from gyre_ray.runtime.scheduler import RunScheduler

    monkeypatch.setattr(reattach, "actor_was_restarted", lambda: True)
    sched = RunScheduler.__new__(RunScheduler)
    sched.run_dir = tmp_path
    sched._reset_cells = lambda: sched.journal.fault({"cell": "cell-1", "lost": "ActorDiedError"})
    header = {"steps": 2, "first_step": 0, "tag": ""}
    assert sched._open_journal(header, 0) is None  # no journal of this run: a new one
    sched.journal.close()
    assert RunJournal.read(tmp_path).faults == [{"cell": "cell-1", "lost": "ActorDiedError"}]
