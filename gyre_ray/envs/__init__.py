"""Agent tasks and their evaluators (what an execution must do, and how its workspace is scored)."""

from gyre_ray.envs.base import EvalResult, Task, get_task_set

__all__ = ["EvalResult", "Task", "get_task_set"]
