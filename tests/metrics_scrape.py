"""Scrape a Prometheus endpoint in the background while something runs (tests of the Ray metrics export)."""

from __future__ import annotations

import re
import threading
import urllib.request
from collections import defaultdict


class Scraper:
    """Polls `http://127.0.0.1:PORT/metrics` every `period_s`; keeps the largest value seen per gyre series."""

    def __init__(self, port: int, period_s: float = 2.0) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.period_s = period_s
        self.max: dict[str, float] = defaultdict(float)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                text = urllib.request.urlopen(self.url, timeout=5).read().decode()
            except OSError:
                continue
            self.samples += 1
            for line in text.splitlines():
                match = re.match(r"^(ray_gyre_\w+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
                if match:
                    name, labels, value = match.groups()
                    key = name + _short_labels(labels or "")
                    self.max[key] = max(self.max[key], float(value))

    def value(self, name: str, **labels: str) -> float:
        """The largest value seen of `name` with these labels (0.0 if never seen)."""
        return self.max.get(name + _format(labels), 0.0)

    def seen(self, name: str, **labels: str) -> bool:
        """Whether a sample of `name` with these labels was scraped at all (a value of 0.0 included)."""
        return name + _format(labels) in self.max

    def names(self) -> set[str]:
        return {key.split("{")[0] for key in self.max}


_KEEP = ("role", "state", "cell", "direction", "api", "status", "le")


def _short_labels(labels: str) -> str:
    pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    return _format({k: v for k, v in pairs.items() if k in _KEEP})


def _format(labels: dict[str, str]) -> str:
    return "{" + ",".join(f"{k}={labels[k]}" for k in sorted(labels)) + "}" if labels else ""
