"""The run's one owner of the cluster: cells, record store, proxy and scheduler actor (`gyre_ray.runtime.cluster`)."""
