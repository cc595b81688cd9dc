"""The proxy as a Ray Serve deployment: a FastAPI ingress over rollout-cell and store actors.

`ProxyDeployment` looks up the (named) cell actors and the trajectory-store actor, builds a
`ProxyService` and serves `build_app(service)`. `proxy_application(settings)` binds it with the
replica options from the `proxy` section; `gyre_ray.proxy.launch.start_proxy` starts everything.

With `settings["direct_ingress"]` the replica also serves HTTP itself (Serve's direct ingress,
`RAY_SERVE_ENABLE_DIRECT_INGRESS`): clients that connect to the replica's own port skip Serve's HTTP
proxy actor, which otherwise adds an actor call per request (and one more to fetch a POST body).
Serve's controller must run with the same variables (`DIRECT_INGRESS_ENV`) to report that port.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ray import serve

from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.app import build_app
from gyre_ray.proxy.clients import RayCellClient, RayStoreClient
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.config import ProxySection
from gyre_ray.proxy.service import ProxyService

# user code on the replica's main loop: awaiting cell and store actors skips a thread hop
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
# Serve's direct ingress, for the controller and the replica; nothing external has to deregister
# the replica before it stops, so it stops without the default 30 s draining period.
DIRECT_INGRESS_ENV = {
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
}


@serve.deployment(
    name="gyre-proxy",
    ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": REPLICA_ENV}},
    max_ongoing_requests=4096,
)
@serve.ingress()
class ProxyDeployment:
    """One proxy replica.

    `settings`: {"proxy": ProxySection dump, "model": ModelSection dump, "namespace": str,
    "cells": {cell_id: actor name}, "store": actor name, "admin_token": str,
    "direct_ingress": bool (optional)}.
    """

    def __init__(self, settings: dict[str, Any]) -> None:
        import ray

        namespace = settings["namespace"]
        section = ProxySection.model_validate(settings["proxy"])
        codec = ChatCodec.for_model(ModelSection.model_validate(settings["model"]))
        cells = {
            cell_id: RayCellClient(cell_id, _named_actor(name, namespace), name, namespace)
            for cell_id, name in settings["cells"].items()
        }
        store = RayStoreClient(ray.get_actor(settings["store"], namespace=namespace))
        self.service = ProxyService(section, codec, cells, store, settings["admin_token"])

    def __serve_build_asgi_app__(self) -> Any:
        return build_app(self.service)

    async def __del__(self) -> None:
        """Replica shutdown: hand the last pending records to the store and wait until it has them."""
        with contextlib.suppress(Exception):  # the store is already gone: nothing left to keep them
            self.service.flush_records()
            await asyncio.wait_for(self.service.store.call("stats"), timeout=30)


def _named_actor(name: str, namespace: str) -> Any:
    """The named actor, or None while it is dead and not yet restarted (its client looks it up later):
    a replica that Serve starts while a cell is down must still start."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def proxy_application(settings: dict[str, Any]) -> Any:
    """The bound Serve application for `settings` (see ProxyDeployment)."""
    section = ProxySection.model_validate(settings["proxy"])
    env = dict(REPLICA_ENV)
    if settings.get("direct_ingress"):
        env.update(DIRECT_INGRESS_ENV)
    options: dict[str, Any] = {"num_cpus": 0, "runtime_env": {"env_vars": env}}
    if settings.get("resources"):  # e.g. the head node's marker: replicas run on the head
        options["resources"] = dict(settings["resources"])
    return ProxyDeployment.options(num_replicas=section.num_replicas, ray_actor_options=options).bind(
        settings
    )
