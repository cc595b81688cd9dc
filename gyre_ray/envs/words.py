"""The `words` task set: the learnable default of `make run`, with a small answer space.

Every task asks the agent to save two colour words with write_file; the evaluator scores the share of
the words in `answer.txt` that are the task's two colours. The warm-up (`gyre_ray.warmup`) teaches the
random tiny policy the chat and tool-call format with replies drawn uniformly from `WORD_POOL` (four
colours, four animals), so RL starts from a policy that writes pool words at random: reward ~0.25
(2 of 8 words), 0.5 once it writes only colours, 1.0 once it writes the task's own pair. Executions
of one task differ in reward (each writes about a dozen words), so group advantages carry signal.
"""

from __future__ import annotations

import re
from pathlib import Path

from gyre_ray.envs.base import EvalResult, Evaluator, Task
from gyre_ray.envs.toy import read_answer

COLOURS = ("red", "gold", "blue", "green")
ANIMALS = ("cat", "dog", "owl", "fox")
WORD_POOL = COLOURS + ANIMALS

_WORD_SPECS = (
    ("sunset", "Save the colours of a sunset with write_file: red and gold.", ("red", "gold")),
    ("flag", "Save the colours of the flag with write_file: red and blue.", ("red", "blue")),
    ("field", "Save the colours of a field at noon with write_file: gold and green.", ("gold", "green")),
    ("sea", "Save the colours of the sea with write_file: blue and green.", ("blue", "green")),
)


def word_share_evaluator(targets: tuple[str, ...]) -> Evaluator:
    """Reward = share of the (lower-cased, letters-only) words of answer.txt that are in `targets`;
    0 when there is no answer or no word in it."""
    wanted = set(targets)

    def evaluate(workspace: Path) -> EvalResult:
        text = read_answer(workspace)
        if isinstance(text, EvalResult):
            return text
        words = re.findall(r"[a-z]+", text.lower())
        hits = sum(w in wanted for w in words)
        reward = hits / len(words) if words else 0.0
        return EvalResult(reward, detail=f"{hits}/{len(words)} words are {'/'.join(targets)}")

    return evaluate


def word_tasks() -> list[Task]:
    """The built-in `words` tasks."""
    return [
        Task(task_id=name, prompt=prompt, evaluate=word_share_evaluator(targets))
        for name, prompt, targets in _WORD_SPECS
    ]
