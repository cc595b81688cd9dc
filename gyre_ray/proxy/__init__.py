"""The agent proxy: OpenAI- and Anthropic-compatible HTTP APIs over rollout cells, with token-exact recording.

Entry points: `gyre_ray.proxy.launch.start_proxy` (Ray Serve), `gyre_ray.proxy.local.build_local_proxy`
(in-process), `gyre-ray serve` (CLI). See docs/proxy.md.
"""
