"""`gyre-ray serve`: start a local Ray, N rollout cells and the proxy; print one JSON line; serve until stopped.

    gyre-ray serve [--config FILE] [--scripted] [cells.num_cells=2 ...]

The JSON line holds `base_url`, `openai_base_url`, `serve_url`, `admin_token`, `cells` and `records_dir`. Ctrl-C or
SIGTERM shuts everything down cleanly. `--scripted` serves the model-free ScriptedEngine (fast start,
for harness development); otherwise the configured policy and engine backend.
"""

from __future__ import annotations

import argparse
import signal
import threading


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="start local Ray, rollout cells and the agent proxy; print base_url and admin token"
    )
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("--scripted", action="store_true", help="serve the model-free scripted engine")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cells.num_cells=2")
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from gyre_ray.cells.factories import ScriptedEngineFactory
    from gyre_ray.config import load_config
    from gyre_ray.proxy.launch import describe, start_proxy

    config = load_config(args.config, args.overrides)
    if not args.scripted:  # a missing or torn model folder fails here, not in every cell
        from gyre_ray.train import check_model_path

        check_model_path(config)
    factory = ScriptedEngineFactory() if args.scripted else None
    handle = start_proxy(config, factory)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after Ray's start-up, which installs its own handlers
        signal.signal(sig, lambda *_: stop.set())
    try:
        print(describe(handle), flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        handle.shutdown()
    return 0
