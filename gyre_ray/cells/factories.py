"""Picklable engine factories a cell calls inside its actor to build its rollout engine.

`PolicyEngineFactory` builds the configured policy (`load_policy`) behind the configured backend
(`make_engine`); `ScriptedEngineFactory` builds the model-free `ScriptedEngine` for tests and
overhead benchmarks. Both carry plain data only, so they travel to Ray actors unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gyre_ray.engines.base import RolloutEngine


@dataclass
class PolicyEngineFactory:
    """The policy from a `model` section behind the backend of an `engine` section (dumped dicts)."""

    model: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    version: int = 0

    def __call__(self) -> RolloutEngine:
        from gyre_ray.engines.config import EngineSection
        from gyre_ray.engines.factory import make_engine
        from gyre_ray.model import load_policy, load_tokenizer_and_args
        from gyre_ray.model.config import ModelSection

        section = ModelSection.model_validate(self.model)
        engine = EngineSection.model_validate(self.engine)
        if engine.backend == "sglang" and section.path:  # its server loads the folder: no torch copy here
            model = None
            tokenizer, args = load_tokenizer_and_args(section)
        else:
            model, tokenizer, args = load_policy(section)
        return make_engine(
            engine,
            model,
            args,
            version=self.version,
            stop_token_ids=tokenizer.stop_ids(),
            model_dir=section.path,
        )


@dataclass
class ScriptedEngineFactory:
    """A `ScriptedEngine` with these keyword arguments."""

    options: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> RolloutEngine:
        from gyre_ray.cells.scripted_engine import ScriptedEngine

        return ScriptedEngine(**self.options)
