"""Reward curves of finished runs side by side: one JSON of per-step rewards and trends, one picture.

    python benchmarks/learning_curves.py --run seed0=RUN_DIR --run seed1=RUN_DIR --run lr0=RUN_DIR \
        [--json benchmarks/results/learning_cpu2.json] [--png docs/images/reward-learn.png]

Each run folder is read from its `metrics.jsonl` (what `gyre-ray train` writes); the trend is the
mean reward of the last 3 steps minus that of the first 3, as the job prints it, and `trend_se` the
standard error of that difference for a policy that does not change, from the run's own step-to-step
spread (sd * sqrt(2/3)), as `tests/test_learning_long.py` uses it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from gyre_ray.train import scored_rewards


def curve(run_dir: Path) -> dict[str, Any]:
    """Per-step mean reward, per-task rewards and the trend of one run folder."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{run_dir}: metrics.jsonl has no steps")
    rewards = scored_rewards(rows)  # a step that scored no execution has no reward (reward_mean null)
    k = min(3, len(rewards))
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    return {
        "run_dir": run_dir.name,  # the run folder's name: no machine paths in committed results
        "steps": len(rows),
        "reward_mean": [None if r["reward_mean"] is None else round(r["reward_mean"], 4) for r in rows],
        "reward_by_task": [r.get("reward_by_task", {}) for r in rows],
        "trend": round(sum(rewards[-k:]) / k - sum(rewards[:k]) / k, 4),
        "trend_se": round(statistics.stdev(rewards) * (2 / 3) ** 0.5, 4) if len(rewards) > 1 else None,
        "trainer": config.get("trainer", {}),
        "model_seed": config.get("model", {}).get("seed"),
    }


def plot(curves: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for label, c in curves.items():
        rewards = [float("nan") if r is None else r for r in c["reward_mean"]]  # None: nothing scored
        ax.plot(range(c["steps"]), rewards, marker="o", label=f"{label} (trend {c['trend']:+.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("Reward per step of the default job (jobs/configs/learn.yaml)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, help="LABEL=RUN_DIR (repeatable)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/learning_cpu2.json"))
    parser.add_argument("--png", type=Path, default=None, help="also draw the curves here")
    args = parser.parse_args()
    curves: dict[str, dict[str, Any]] = {}
    for item in args.run:
        label, sep, folder = item.rpartition("=")  # a label may hold "=" (lr=0)
        if not sep or not folder:
            parser.error(f"--run takes LABEL=RUN_DIR, got {item!r}")
        curves[label] = curve(Path(folder))
        c = curves[label]
        print(f"{label}: trend {c['trend']:+.3f} (se {c['trend_se']}); per step {c['reward_mean']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"benchmark": "learning_curves", "runs": curves}, indent=2))
    print(f"wrote {args.json}")
    if args.png:
        plot(curves, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
