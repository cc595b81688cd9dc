"""Import every built-in policy so that each registers itself (`make_policy` imports this)."""

from gyre_ray.scheduling.colocate import ColocatePolicy
from gyre_ray.scheduling.elastic import ElasticPolicy
from gyre_ray.scheduling.fixed_split import AsyncPolicy

__all__ = ["AsyncPolicy", "ColocatePolicy", "ElasticPolicy"]
