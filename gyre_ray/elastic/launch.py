"""Start the proxy in front of dual-role cells: the machinery the elastic runtime (and the job) runs on.

`start_elastic_proxy(config)` is `gyre_ray.proxy.launch.start_proxy` with a trainer replica in every
cell (`DualRoleCell`; the first cell is the core). The Serve proxy only calls the rollout methods,
which a dual-role cell keeps, so routing, recording and drain work unchanged.
"""

from __future__ import annotations

from typing import Any

from gyre_ray.cells.cell import EngineFactory
from gyre_ray.cells.dual_role import TrainerFactory
from gyre_ray.config import GyreConfig


def trainer_factory_for(config: GyreConfig) -> TrainerFactory:
    """The trainer replica every cell builds: the job's model, trainer and algo sections."""
    return TrainerFactory(config.model.model_dump(), config.trainer.model_dump(), config.algo.model_dump())


def start_elastic_proxy(
    config: GyreConfig,
    engine_factory: EngineFactory | None = None,
    trainer_factory: TrainerFactory | None = None,
    *,
    app_name: str = "gyre-proxy",
    timeout_s: float = 300.0,
) -> Any:
    """Store, `proxy.num_cells` dual-role cells and the Serve proxy; returns a `ProxyHandle`."""
    from gyre_ray.proxy.launch import start_proxy

    return start_proxy(
        config,
        engine_factory,
        trainer_factory=trainer_factory or trainer_factory_for(config),
        app_name=app_name,
        timeout_s=timeout_s,
    )
