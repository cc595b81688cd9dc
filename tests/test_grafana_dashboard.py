"""The Grafana dashboard shows every metric gyre-ray exports, under the names Ray exports them."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dashboard_queries_every_exported_metric_and_nothing_else() -> None:
    source = (ROOT / "gyre_ray" / "observability" / "ray_metrics.py").read_text()
    exported = set(re.findall(r'"(gyre_[a-z_]+)"', source))
    assert len(exported) >= 12
    dashboard = json.loads((ROOT / "deployments" / "grafana" / "gyre-ray.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    queried = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"ray_(gyre_[a-z_]+)", exprs)}
    assert queried - exported == set(), "the dashboard queries metrics nobody exports"
    unshown = exported - queried
    assert unshown == set(), f"exported but not on the dashboard: {sorted(unshown)}"
