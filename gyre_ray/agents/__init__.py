"""Agent harnesses and the runner that executes them against the proxy in fresh workspaces."""
