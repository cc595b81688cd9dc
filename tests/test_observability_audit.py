"""An audit of what a user watches a run through: `gyre-ray report` pictures of odd runs (one step,
steps that trained nothing, NaN figures, no step yet, a failed run, stale pictures), `gyre-ray runs`
(NaN rewards, a damaged newest checkpoint, long names), wandb (a resumed run's first evaluation, a
failing finish, disabled mode), the Ray metrics and the Grafana dashboard (every query names an
exported metric with its labels, units, distinct legends, a true mean staleness) and the metric
table of docs/observability.md. Each test failed before its fix, but for two that pin what the docs
say (wandb disabled; the docs' metric table, which matched the code before a metric was added)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_cli_inputs_report import GOOD_STEP, GOOD_TRACE
from test_cli_inputs_report import _report as report_command
from test_cli_inputs_report import _run as odd_run
from test_report import PNG
from test_report import _run_dir as run_dir
from test_runs_cli import make_run

from gyre_ray.checkpoint import CHECKPOINTS, STATE_FILE, TRAINER_DIR, checkpoint_name
from gyre_ray.cli import main
from gyre_ray.observability import ray_metrics, report
from gyre_ray.observability.metrics import MetricsLogger
from gyre_ray.runs_cli import format_runs, list_runs

ROOT = Path(__file__).resolve().parents[1]


# ---- gyre-ray report: what each picture shows ---------------------------------------------------
@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The figure of each picture `make_report` writes, by file name (inspected after it is saved)."""
    figures: dict[str, Any] = {}
    save = report._save

    def keep(fig: Any, path: Path) -> Path:
        figures[path.name] = fig
        return save(fig, path)

    monkeypatch.setattr(report, "_save", keep)
    return figures


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _texts(fig: Any) -> str:
    return " ".join(t.get_text() for t in fig.axes[0].texts)


def _labels(fig: Any) -> list[str]:
    legend = fig.axes[0].get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend is not None else []


def test_a_step_that_trained_no_token_is_a_gap_in_staleness_not_a_lag_of_0(
    tmp_path: Path, drawn: dict[str, Any]
) -> None:
    run = run_dir(tmp_path)
    rows = _rows(run / "metrics.jsonl")
    skipped = {"hist": {}, "max": 0, "mean": 0.0, "tokens": 0}  # what a step that scored nothing logs
    rows.append({**rows[1], "step": 2, "reward_mean": None, "staleness": skipped, "skipped": "no update"})
    rows.append({**rows[1], "step": 3, "staleness": {"hist": {"1": 5}, "max": 1, "mean": 1.0, "tokens": 5}})
    _write(run / "metrics.jsonl", rows)
    report.write_report(run)
    ax = drawn["staleness.png"].axes[0]
    (mean,) = [line for line in ax.lines if line.get_label() == "mean"]
    means = dict(zip(mean.get_xdata(), mean.get_ydata(), strict=True))
    assert means[1] == 0.4 and means[3] == 1.0 and math.isnan(means[2])  # was 0.0: "no lag"
    bars = {round(p.get_x() + p.get_width() / 2): p.get_height() for p in ax.patches}
    assert 2 not in bars and bars[3] == 1
    assert "no token trained at step 2" in _texts(drawn["staleness.png"])


def test_a_recovered_update_without_figures_is_not_called_untrained(
    tmp_path: Path, drawn: dict[str, Any]
) -> None:
    """The row a restarted scheduler writes for an update it found applied has no staleness figures:
    a gap, said to be unlogged, not "no token trained" (it trained)."""
    run = run_dir(tmp_path)
    rows = _rows(run / "metrics.jsonl")
    rows.append({"step": 2, "recovered_after_scheduler_restart": True})
    _write(run / "metrics.jsonl", rows)
    report.write_report(run)
    said = _texts(drawn["staleness.png"])
    assert "no staleness logged at step 2" in said and "no token trained" not in said


def test_a_run_that_trained_nothing_says_so_in_its_pictures(tmp_path: Path, drawn: dict[str, Any]) -> None:
    skipped = {"hist": {}, "max": 0, "mean": 0.0, "tokens": 0}
    rows = [{"step": s, "reward_mean": None, "staleness": skipped, "reward_by_task": {}} for s in range(3)]
    _write(tmp_path / "metrics.jsonl", rows)
    report.write_report(tmp_path)
    assert "no step scored an execution" in _texts(drawn["reward.png"])
    assert "no step trained a token" in _texts(drawn["staleness.png"])
    assert drawn["staleness.png"].axes[0].get_ylim()[0] > -0.1  # no negative lags on the axis


def _ticks_shown(ax: Any) -> list[float]:
    lo, hi = ax.get_xlim()
    return [t for t in ax.get_xticks() if lo <= t <= hi]


def test_a_one_step_run_has_whole_steps_on_its_axes(tmp_path: Path, drawn: dict[str, Any]) -> None:
    _write(tmp_path / "metrics.jsonl", [{**GOOD_STEP, "reward_by_task": {"vowels": 0.5}}])
    _write(
        tmp_path / "eval.jsonl",
        [
            {
                "step": 0,
                "reward_mean": 0.5,
                "pass_rate": 0.5,
                "tasks": {"t": {"reward": 0.5, "pass_rate": 0.5}},
            }
        ],
    )
    report.write_report(tmp_path)
    for name in ("reward.png", "staleness.png", "eval.png"):
        assert _ticks_shown(drawn[name].axes[0]) == [0.0], name  # was -0.04, -0.02, 0.00, 0.02, 0.04
    low, _ = drawn["staleness.png"].axes[0].get_ylim()
    assert low > -0.1  # was -0.04 "versions behind" with ticks below 0


def test_a_picture_with_no_step_names_no_step_on_its_axis(tmp_path: Path, drawn: dict[str, Any]) -> None:
    report.write_report(run_dir(tmp_path))  # no evaluation
    assert list(drawn["eval.png"].axes[0].get_xticks()) == []  # was a lone tick 0: a step not there


def test_a_task_that_ran_but_scored_nothing_is_a_gap_in_its_line(
    tmp_path: Path, drawn: dict[str, Any]
) -> None:
    """A task's line bridged a step at which every one of its executions was dropped, as if it had not
    run there; the mean's line has a gap at such a step."""
    (tmp_path / "traced").mkdir()
    run = run_dir(tmp_path / "traced")
    trace = _rows(run / "trace.jsonl")
    dropped = {"start": 13.0, "end": 14.0, "task": "s2-vowels", "step": 2, "reward": None, "dropped": True}
    _write(run / "trace.jsonl", [*trace, dropped, {**dropped, "task": "s3-vowels", "step": 3, "reward": 0.4,
                                                   "dropped": False}])  # fmt: skip
    report.write_report(run)
    (vowels,) = [line for line in drawn["reward.png"].axes[0].lines if line.get_label() == "vowels"]
    ys = dict(zip(vowels.get_xdata(), vowels.get_ydata(), strict=True))
    assert list(ys) == [0, 1, 2, 3] and math.isnan(ys[2]) and ys[3] == 0.4  # was [0, 1, 3]: a line over 2
    metrics_only = tmp_path / "untraced"  # a killed run: the per-task rewards from metrics.jsonl
    metrics_only.mkdir()
    by_task = ({"vowels": 0.5}, {"vowels": None, "other": 0.2}, {"vowels": 0.7})
    _write(
        metrics_only / "metrics.jsonl",
        [{**GOOD_STEP, "step": s, "reward_by_task": t} for s, t in enumerate(by_task)],
    )
    report.write_report(metrics_only)
    (vowels,) = [line for line in drawn["reward.png"].axes[0].lines if line.get_label() == "vowels"]
    assert math.isnan(vowels.get_ydata()[1])


def eval_run(tmp_path: Path, tasks: int) -> Path:
    """A run folder whose eval.jsonl has `tasks` tasks at steps 0 and 2."""
    run = run_dir(tmp_path)
    scored = {f"task-{k}": {"reward": k / 10, "pass_rate": 0.0} for k in range(tasks)}
    _write(
        run / "eval.jsonl",
        [{"step": s, "reward_mean": 0.3, "pass_rate": 0.1, "tasks": scored} for s in (0, 2)],
    )
    return run


def test_no_eval_task_wears_the_pass_rates_colour(tmp_path: Path, drawn: dict[str, Any]) -> None:
    from matplotlib.colors import to_rgb

    report.write_report(eval_run(tmp_path, 4))
    colours = {line.get_label(): to_rgb(line.get_color()) for line in drawn["eval.png"].axes[0].lines}
    passes = colours.pop("pass rate")
    nearest = min(math.dist(passes, colour) for colour in colours.values())
    assert nearest > 0.2  # was 0.13: task-2's tab:green beside the pass rate's green


def test_the_timeline_names_its_dotted_lines(tmp_path: Path, drawn: dict[str, Any]) -> None:
    report.write_report(run_dir(tmp_path))
    assert "update published" in _labels(drawn["timeline.png"])  # was unnamed dotted lines
    (tmp_path / "trace.jsonl").unlink()
    report.write_report(tmp_path)
    running = drawn["timeline.png"].axes[1]  # was a flat 0 on an axis of -0.04 to 0.04 executions
    assert "executions running are unknown" in running.texts[0].get_text()
    assert list(running.get_yticks()) == []


def test_legends_sit_beside_the_plot_not_over_its_lines(tmp_path: Path, drawn: dict[str, Any]) -> None:
    report.write_report(eval_run(tmp_path, 8))
    for name in ("reward.png", "staleness.png", "eval.png"):
        fig = drawn[name]
        ax, legend = fig.axes[0], fig.axes[0].get_legend()
        box = legend.get_window_extent()
        assert box.x0 >= ax.get_window_extent().x1, name  # was inside the axes (over step 0-1 in staleness)


def test_an_eval_task_that_scored_nothing_says_so_in_the_legend(
    tmp_path: Path, drawn: dict[str, Any]
) -> None:
    run = run_dir(tmp_path)
    tasks = {"scored": {"reward": 0.5, "pass_rate": 0.0}, "dropped": {"reward": None, "pass_rate": 0.0}}
    _write(run / "eval.jsonl", [{"step": 0, "reward_mean": 0.5, "pass_rate": 0.0, "tasks": tasks}])
    report.write_report(run)
    labels = _labels(drawn["eval.png"])
    assert "dropped (none scored)" in labels and "scored" in labels  # was "dropped", with no line


@pytest.mark.parametrize(
    ("name", "row", "message"),
    [
        (
            "metrics.jsonl",
            {**GOOD_STEP, "reward_mean": math.nan},
            "metrics.jsonl:1: reward_mean NaN is not a number",
        ),
        ("metrics.jsonl", {**GOOD_STEP, "reward_mean": math.inf}, "reward_mean Infinity is not a number"),
        (
            "metrics.jsonl",
            {**GOOD_STEP, "staleness": {"max": 0, "mean": math.nan}},
            "metrics.jsonl:1: staleness.mean NaN is not a number",
        ),
        ("trace.jsonl", {**GOOD_TRACE, "end": math.inf}, "trace.jsonl:1: end Infinity is not a number"),
    ],
)
def test_a_nan_or_infinite_figure_is_named_not_silently_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture, name: str, row: dict, message: str
) -> None:
    """Python's json reads NaN and Infinity; the pictures dropped such a point without a word."""
    rows = {"metrics.jsonl": [GOOD_STEP], "trace.jsonl": [GOOD_TRACE], name: [row]}
    code, _, err = report_command(capsys, odd_run(tmp_path, rows["metrics.jsonl"], rows["trace.jsonl"]))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_failed_run_says_so_first(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = run_dir(tmp_path)
    (run / "summary.json").unlink()
    (run / "failed.json").write_text(json.dumps({"error": "RuntimeError: the core died", "steps_logged": 2}))
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        out[1] == "gyre-ray report: the run stopped before its end (failed.json): RuntimeError: the core died"
    )
    assert "the run stopped before its end" in (run / "report" / "index.html").read_text()


def test_steps_missing_with_a_trace_is_said_not_drawn_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture, drawn: dict[str, Any]
) -> None:
    run = run_dir(tmp_path)
    (run / "metrics.jsonl").write_text("")
    assert main(["report", str(run)]) == 0
    assert "reward.png and staleness.png have no step to show" in capsys.readouterr().out
    assert "no step logged yet" in _texts(drawn["reward.png"])
    assert "no step logged yet" in _texts(drawn["staleness.png"])
    assert _labels(drawn["staleness.png"]) == []  # no legend of empty series


def test_pictures_an_earlier_report_drew_do_not_outlive_their_data(tmp_path: Path) -> None:
    run = run_dir(tmp_path)
    index = report.write_report(run)
    assert (index.parent / "timeline.png").read_bytes()[:8] == PNG
    (run / "summary.json").write_text('{"steps": [{"st')  # torn: the timeline is left out now
    report.write_report(run)
    assert not (index.parent / "timeline.png").exists() and not (index.parent / "switches.png").exists()


# ---- gyre-ray runs ---------------------------------------------------------------------------------
def test_a_nan_reward_is_noted_and_runs_json_stays_json(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = make_run(tmp_path, "nan", 4, [0.1, 0.2], 100.0)
    (folder / "metrics.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in ({"step": 0, "reward_mean": 0.1}, {"step": 1, "reward_mean": math.nan})
        )
    )
    (run,) = list_runs(tmp_path)
    assert run["reward_last"] == 0.1 and "line 2: reward_mean NaN is not a number" in run["error"]
    assert main(["runs", str(tmp_path), "--json"]) == 0

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is no JSON")

    json.loads(capsys.readouterr().out, parse_constant=refuse)  # jq and other readers refuse NaN


def _checkpoint(folder: Path, step: int, state: str | None = None) -> None:
    saved = folder / CHECKPOINTS / checkpoint_name(step)
    (saved / TRAINER_DIR).mkdir(parents=True)
    (saved / STATE_FILE).write_text(state if state is not None else json.dumps({"step": step}))


def test_a_damaged_newest_checkpoint_points_to_the_one_resume_would_use(tmp_path: Path) -> None:
    folder = make_run(tmp_path, "done", 4, [0.1, 0.2, 0.3, 0.4], 100.0, checkpoint=2)
    (folder / "summary.json").write_text(json.dumps({"costs": {"makespan_s": 5.0}}))
    _checkpoint(folder, 4, state='{"step": 4')  # torn
    (run,) = list_runs(tmp_path)
    # was: stopped, no checkpoint, "start again", while `--resume` would go on from step 2
    assert run["status"] == "done" and run["checkpoint_step"] == 2
    assert run["error"] == "step-000004: its state.json holds no step number"
    assert run["next"] == f"gyre-ray train --resume {folder} run.steps=N (more steps)"


def test_a_long_run_name_keeps_the_columns(tmp_path: Path) -> None:
    make_run(tmp_path, "short", 2, [0.5], 100.0)
    make_run(tmp_path, "a-run-named-by-run-name-that-is-rather-long-42", 2, [0.5], 200.0)
    lines = format_runs(list_runs(tmp_path), tmp_path).splitlines()[:3]
    assert len({line.index(" stopped") for line in lines[1:]}) == 1
    assert lines[0].index("status") == lines[1].index("stopped")


# ---- wandb ---------------------------------------------------------------------------------------
class FakeRun:
    """Stands in for a wandb run: keeps what is logged, at which step; `finish` may fail."""

    def __init__(self, fail_finish: bool = False) -> None:
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.fail_finish = fail_finish

    def define_metric(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log(self, data: dict[str, Any], step: int) -> None:
        self.logged.append((step, data))

    def finish(self) -> None:
        if self.fail_finish:
            raise OSError("upload failed")


def _fake_wandb(monkeypatch: pytest.MonkeyPatch, run: FakeRun) -> None:
    fake = SimpleNamespace(
        init=lambda **kwargs: run, Settings=lambda **kwargs: None, Table=lambda **kwargs: kwargs
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)


ROUND = {"step": 4, "reward_mean": 0.5, "pass_rate": 0.5, "tasks": {}}


def test_a_resumed_runs_first_evaluation_goes_to_the_step_it_resumes_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online, wandb resumes a run after its last step and drops anything logged below it: the round
    that ended before the resumed segment's first row went to step 0."""
    run = FakeRun()
    _fake_wandb(monkeypatch, run)
    _write(tmp_path / "metrics.jsonl", [{"step": s, "reward_mean": 0.1} for s in range(4)])
    logger = MetricsLogger(tmp_path, "run", {}, "online", resume=True)
    logger.log_eval(ROUND)
    logger.log(4, {"reward_mean": 0.2})
    logger.log_eval({**ROUND, "step": 5})
    logger.finish_run({"switches": []}, None)
    assert [step for step, _ in run.logged] == [4, 4, 4, 4]
    fresh = FakeRun()
    _fake_wandb(monkeypatch, fresh)
    (tmp_path / "new").mkdir()
    MetricsLogger(tmp_path / "new", "new", {}, "online").log_eval(ROUND)
    assert [step for step, _ in fresh.logged] == [0]  # a new run's round before its first step: step 0


def test_a_wandb_finish_that_fails_does_not_stop_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _fake_wandb(monkeypatch, FakeRun(fail_finish=True))
    logger = MetricsLogger(tmp_path, "run", {}, "online")
    logger.log(0, {"reward_mean": 0.5})
    logger.close()  # raised OSError, hiding the run's summary (or its own error) in train's `finally`
    assert "wandb unavailable (OSError: upload failed)" in capsys.readouterr().err
    logger.close()
    assert _rows(tmp_path / "metrics.jsonl") == [{"step": 0, "reward_mean": 0.5}]


def test_wandb_disabled_imports_and_writes_nothing_for_wandb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import would raise ImportError
    logger = MetricsLogger(tmp_path, "run", {}, "disabled")
    logger.log(0, {"reward_mean": 0.5, "staleness": {"max": 0}})
    logger.log_eval({**ROUND, "step": 1})
    logger.finish_run({"switches": []}, None)
    logger.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert _rows(tmp_path / "metrics.jsonl") == [{"step": 0, "reward_mean": 0.5, "staleness": {"max": 0}}]


# ---- Ray metrics, the Grafana dashboard, the docs' table -------------------------------------------
class Recorded:
    """A metric `_make` was asked for: its kind, name and labels, and the values set or observed."""

    def __init__(self, kind: str, name: str, tags: tuple[str, ...], options: dict[str, Any]) -> None:
        self.kind, self.name, self.tags, self.options = kind, name, tags, options
        self.values: list[float] = []

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values.append(value)

    inc = observe = set


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> dict[str, Recorded]:
    """Every metric the scheduler and the proxy export, by name, as they make them."""
    made: dict[str, Recorded] = {}

    def make(kind: str, name: str, description: str, tags: tuple[str, ...], **options: Any) -> Recorded:
        made[name] = Recorded(kind, name, tags, options)
        return made[name]

    monkeypatch.setattr(ray_metrics, "_make", make)
    made["runtime"] = ray_metrics.RuntimeMetrics.create()  # type: ignore[assignment]
    ray_metrics.ProxyMetrics()
    return made


def test_the_mean_staleness_is_exported_exactly(exported: dict[str, Recorded]) -> None:
    """The dashboard read the mean from the histogram's _sum / _count, which Ray sums from bucket
    midpoints (a lag-0 token counts 0.25: an on-policy run showed 0.25) over a 10,000-token sample."""
    runtime: Any = exported.pop("runtime")
    runtime.trained_staleness({0: 30_000, 1: 10_000})
    assert exported["gyre_staleness_mean"].values == [0.25] and exported["gyre_staleness_max"].values == [1.0]
    runtime.trained_staleness({})  # a step that trained nothing leaves the last update's figures
    assert exported["gyre_staleness_mean"].values == [0.25]


def test_switch_latency_buckets_resolve_a_cpu_cells_switches(exported: dict[str, Recorded]) -> None:
    """The default job's switches take 0.02-0.2 s (runs/learn-*: 0.016-0.18 s): all in one bucket
    (<= 0.25 s), every quantile on the dashboard was made up by interpolation (p50 0.125 s)."""
    bounds = exported["gyre_switch_seconds"].options["boundaries"]
    measured = [0.019, 0.024, 0.036, 0.065, 0.098, 0.12, 0.137, 0.184]
    assert len({next(b for b in bounds if s <= b) for s in measured}) >= 3


def _dashboard() -> list[dict[str, Any]]:
    return json.loads((ROOT / "deployments" / "grafana" / "gyre-ray.json").read_text())["panels"]


def _exported_series(exported: dict[str, Recorded]) -> dict[str, set[str]]:
    """The series names Ray serves (`ray_` prefix; a histogram's _bucket, _sum, _count) -> their labels."""
    series: dict[str, set[str]] = {}
    for m in exported.values():
        if not isinstance(m, Recorded):
            continue
        if m.kind == "Histogram":
            series[f"ray_{m.name}_bucket"] = {*m.tags, "le"}
            series[f"ray_{m.name}_sum"] = series[f"ray_{m.name}_count"] = set(m.tags)
        else:
            series[f"ray_{m.name}"] = set(m.tags)
    return series


def test_every_panel_queries_exported_series_by_their_labels_with_a_unit_and_named_lines(
    exported: dict[str, Recorded],
) -> None:
    series = _exported_series(exported)
    for panel in _dashboard():
        title = panel["title"]
        assert panel.get("fieldConfig", {}).get("defaults", {}).get("unit"), f"{title}: no unit"
        legends = [t.get("legendFormat") for t in panel["targets"]]
        assert all(legends) and len(set(legends)) == len(legends), f"{title}: lines not told apart: {legends}"
        for target in panel["targets"]:
            expr = target["expr"]
            names = re.findall(r"\bray_gyre_\w+", expr)
            assert names and set(names) <= set(series), f"{title}: {expr}"
            for labels in re.findall(r"by \(([^)]*)\)", expr):
                wanted = {label.strip() for label in labels.split(",")}
                assert all(wanted <= series[n] for n in names), f"{title}: {expr} groups by {wanted}"
            assert not ("_sum" in expr and "_count" in expr), f"{title}: a mean from bucket midpoints"
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for p in _dashboard() for t in p["targets"]
             for n in re.findall(r"\bray_(gyre_\w+)", t["expr"])}  # fmt: skip
    assert shown == {m.name for m in exported.values() if isinstance(m, Recorded)}


def test_the_docs_table_names_every_metric_with_its_kind_and_labels(exported: dict[str, Recorded]) -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    table = doc[doc.index("| metric | kind | labels | meaning |") : doc.index("A cluster's Ray exports them")]
    documented: dict[str, tuple[str, set[str]]] = {}
    for line in [row for row in table.splitlines() if row.startswith("|")][2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        names, kinds = re.findall(r"`(gyre_\w+)`", cells[0]), [k.strip() for k in cells[1].split(",")]
        labels = {re.sub(r"\s*\(.*", "", cells[2])} - {""}
        for name, kind in zip(names, kinds * len(names) if len(kinds) == 1 else kinds, strict=True):
            documented[name] = (kind, labels)
    made = {m.name: (m.kind.lower(), set(m.tags)) for m in exported.values() if isinstance(m, Recorded)}
    assert documented == made
