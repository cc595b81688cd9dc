"""The SGLang rollout engine (`engine.backend=sglang`): one SGLang server per cell, driven over HTTP.

`launch_engine` is what `make_engine` calls inside a cell: it finds the cell's name and GPUs
(Ray's actor name and `ray.get_gpu_ids()` inside a cell actor), starts `sglang.launch_server`
on them (or connects to `engine.sglang.url`), waits until it is healthy and returns an
`SGLangEngine` that stops the server on `shutdown`. A server it starts gets a fresh random API key
(given to SGLang in a 0600 `--config` file, never on the command line) that only this cell's client
holds, so no other process on the machine (an agent's execution included) can call the server's
routes; a server at `engine.sglang.url` gets the key named by `engine.sglang.api_key_env`. Real
SGLang needs a CUDA GPU; without one (or without the package) this raises `SGLangUnavailableError`
saying which is missing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from gyre_ray.engines.config import EngineSection
from gyre_ray.engines.sglang.client import SGLangClient, SGLangServerError
from gyre_ray.engines.sglang.engine import SGLangEngine
from gyre_ray.engines.sglang.server import (
    SGLangServer,
    SGLangUnavailableError,
    check_available,
    launch_command,
    new_api_key,
    write_key_config,
)
from gyre_ray.ports import free_port

__all__ = [
    "SGLangClient",
    "SGLangEngine",
    "SGLangServer",
    "SGLangServerError",
    "SGLangUnavailableError",
    "launch_engine",
]


def _cell_context() -> tuple[str, list[str]]:
    """(cell name, GPU ids) of the calling Ray actor; outside Ray: ("engine", CUDA_VISIBLE_DEVICES or all)."""
    try:
        import ray

        if ray.is_initialized():
            context = ray.get_runtime_context()
            name = context.get_actor_name() or "engine"
            return name, [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # not in a Ray worker
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return "engine", [g for g in visible.split(",") if g.strip()]
    import torch

    return "engine", [str(i) for i in range(torch.cuda.device_count())]


def _external_key(variable: str | None, cell_id: str) -> str | None:
    """The key of a server at engine.sglang.url: the value of `variable` in this process (None: no key)."""
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise ValueError(
            f"cell {cell_id}: engine.sglang.api_key_env={variable!r} names an environment variable that is "
            "unset or empty in this process"
        )
    return key


def launch_engine(
    section: EngineSection,
    model: Any,
    args: Any,
    *,
    version: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    model_dir: str | None = None,
    cell_id: str | None = None,
    gpu_ids: Sequence[int | str] | None = None,
) -> SGLangEngine:
    """An `SGLangEngine` for this cell: its own server on its GPUs, or `section.sglang.url`.

    `model_dir`: the HF folder the server loads; None saves `model` into a temporary folder first
    (a preset model with random weights). `stop_token_ids` default: the model's eos.
    """
    options = section.sglang
    found_cell, found_gpus = _cell_context()
    cell_id = cell_id or found_cell
    gpus = [str(g) for g in (gpu_ids if gpu_ids is not None else found_gpus)]
    if stop_token_ids is None:
        stop_token_ids = [] if args.eos_token_id is None else [args.eos_token_id]
    server = None
    owned: list[str] = []
    if options.url:
        url = options.url
        api_key = _external_key(options.api_key_env, cell_id)
    else:
        check_available(cell_id, gpus)
        if model_dir is None:
            from gyre_ray.model.checkpoint import save_hf

            if model is None:
                raise ValueError(f"cell {cell_id}: the SGLang engine needs model_dir or the model to save")
            model_dir = str(save_hf(model, args, tempfile.mkdtemp(prefix=f"gyre-sglang-{cell_id}-model-")))
            owned.append(model_dir)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        api_key = new_api_key()
        key_dir = tempfile.mkdtemp(prefix=f"gyre-sglang-{cell_id}-key-")  # 0700, this uid's
        owned.append(key_dir)
        try:
            key_file = write_key_config(api_key, key_dir)
            command = launch_command(
                model_dir,
                port,
                options,
                gpu_count=len(gpus),
                max_running_requests=section.max_batch_size,
                radix_cache=section.prefix_cache_tokens > 0,
                key_config=key_file,
            )
        except BaseException:  # e.g. a refused extra_args: leave no folder behind
            for folder in owned:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        server = SGLangServer(
            command, url, gpus, cell_id, owned_dirs=owned, api_key=api_key, key_file=key_file
        )
    if server is not None:
        server.start()
        try:
            server.wait_healthy(options.startup_timeout_s)
        except BaseException:
            server.stop()
            raise
    client = SGLangClient(url, cell_id, options.connect_timeout_s, options.request_timeout_s, api_key=api_key)
    return SGLangEngine(
        client,
        vocab_size=args.vocab_size,
        max_context=args.max_position_embeddings,
        stop_token_ids=stop_token_ids,
        version=version,
        weight_sync=options.weight_sync,
        model_config=args.to_hf_config(),
        server=server,
        tp_size=options.tp_size or max(1, len(gpus)),
    )
