"""The `words` task set: a small answer space for RL after the warm-up (jobs/configs/learn.yaml).

Every task asks the agent to save two words for units of time with write_file; the evaluator scores the
share of the words in `answer.txt` that are the task's two. The warm-up (`gyre_ray.warmup`) teaches the
random tiny policy the chat and tool-call format with replies drawn uniformly from `WORD_POOL` (four
units of time, four objects; each word is one token of the tiny tokenizer, with or without a leading
space, so a word is one choice), so RL starts from a policy that writes pool words at random: reward
~0.25 (2 of 8 words), 0.5 once it writes only units of time, 1.0 once it writes the task's own pair.
Executions of one task differ in reward (each writes about a dozen words), so group advantages carry
signal.
"""

from __future__ import annotations

import re
from pathlib import Path

from gyre_ray.envs.base import EvalResult, Evaluator, Task
from gyre_ray.envs.toy import read_answer

TIME_WORDS = ("hour", "day", "week", "year")
OBJECTS = ("tree", "box", "key", "map")
WORD_POOL = TIME_WORDS + OBJECTS

# In this order a job taking two tasks per step (cycling through the set) gets a complementary pair
# every step, hour-day + week-year or hour-week + day-year, so each step's gradient favours all four
# units of time alike; in alphabetical order every other step held only tasks with "hour" (or none),
# and the policy swung towards and away from it from step to step.
_WORD_SPECS = (
    ("hour-day", "Save two units of time with write_file: hour and day.", ("hour", "day")),
    ("week-year", "Save two units of time with write_file: week and year.", ("week", "year")),
    ("hour-week", "Save two units of time with write_file: hour and week.", ("hour", "week")),
    ("day-year", "Save two units of time with write_file: day and year.", ("day", "year")),
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
