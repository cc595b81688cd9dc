"""The proxy as a Ray Serve deployment: a FastAPI ingress over rollout-cell and store actors.

`ProxyDeployment` looks up the (named) cell actors and the trajectory-store actor, builds a
`ProxyService` and serves `build_app(service)`. `proxy_application(settings)` binds it with the
replica options from the `proxy` section; `gyre_ray.proxy.launch.start_proxy` starts everything.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.app import build_app
from gyre_ray.proxy.clients import RayCellClient, RayStoreClient
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.config import ProxySection
from gyre_ray.proxy.service import ProxyService


@serve.deployment(
    name="gyre-proxy",
    ray_actor_options={
        "num_cpus": 0,
        # user code on the replica's main loop: awaiting cell and store actors skips a thread hop
        "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}},
    },
    max_ongoing_requests=4096,
)
@serve.ingress()
class ProxyDeployment:
    """One proxy replica.

    `settings`: {"proxy": ProxySection dump, "model": ModelSection dump, "namespace": str,
    "cells": {cell_id: actor name}, "store": actor name, "admin_token": str}.
    """

    def __init__(self, settings: dict[str, Any]) -> None:
        import ray

        namespace = settings["namespace"]
        section = ProxySection.model_validate(settings["proxy"])
        codec = ChatCodec.for_model(ModelSection.model_validate(settings["model"]))
        cells = {
            cell_id: RayCellClient(cell_id, ray.get_actor(name, namespace=namespace))
            for cell_id, name in settings["cells"].items()
        }
        store = RayStoreClient(ray.get_actor(settings["store"], namespace=namespace))
        self.service = ProxyService(section, codec, cells, store, settings["admin_token"])

    def __serve_build_asgi_app__(self) -> Any:
        return build_app(self.service)


def proxy_application(settings: dict[str, Any]) -> Any:
    """The bound Serve application for `settings` (see ProxyDeployment)."""
    section = ProxySection.model_validate(settings["proxy"])
    return ProxyDeployment.options(num_replicas=section.num_replicas).bind(settings)
