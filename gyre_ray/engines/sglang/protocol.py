"""The JSON shapes of SGLang's /generate, both ways: a request body from our types, tokens from its chunks.

`generate_body` maps a `GenerateRequest` to SGLang's body (`input_ids`, `sampling_params`,
`return_logprob`, `rid`); `token_versions` reads which weight version produced each token. `ChunkReader` turns the stream of chunks into new (token, logprob)
pairs: SGLang sends `meta_info.output_token_logprobs` as `[logprob, token_id, text]` triples,
cumulative by default and as deltas with `--incremental-streaming-output`; the reader tells the
two apart by `meta_info.completion_tokens` (the running total), so either server setting works.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gyre_ray.engines.base import FinishReason, GenerateRequest, SamplingParams

_FINISH_TYPES: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def sampling_params(sampling: SamplingParams, engine_stop_ids: Iterable[int]) -> dict[str, Any]:
    """SGLang `sampling_params` for ours. Stop ids = the engine's plus the request's; with none at all
    the server's own eos check is off too (`ignore_eos`), as in the torch engine."""
    stop_ids = sorted(set(engine_stop_ids) | set(sampling.stop_token_ids))
    params: dict[str, Any] = {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "max_new_tokens": int(sampling.max_new_tokens),
        "stop_token_ids": stop_ids,
        "ignore_eos": not stop_ids,
        "skip_special_tokens": False,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = int(sampling.seed)
    return params


def generate_body(request: GenerateRequest, engine_stop_ids: Iterable[int]) -> dict[str, Any]:
    return {
        "rid": request.rid,
        "input_ids": list(request.input_ids),
        "sampling_params": sampling_params(request.sampling, engine_stop_ids),
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def finish_reason(meta_info: dict[str, Any]) -> FinishReason | None:
    """`meta_info.finish_reason.type` as ours (None while running); an unknown type counts as abort."""
    reason = meta_info.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    return _FINISH_TYPES.get(str(kind), "abort")


def _as_int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def token_versions(meta_info: dict[str, Any], first: int, count: int, default: int) -> list[int]:
    """Weight version of output tokens `first .. first+count-1`.

    SGLang 0.5.23 sends `weight_versions` spans ({version, start, end}: the tokens [start, end) came
    from that version; we send str(version)); older servers one `weight_version` for the request.
    Versions that are not integers fall back to `default` (the engine's own count).
    """
    spans = meta_info.get("weight_versions")
    fallback = _as_int(meta_info.get("weight_version", default), default)
    if not isinstance(spans, list) or not spans:
        return [fallback] * count
    out = []
    for index in range(first, first + count):
        span = next((s for s in spans if int(s.get("start", 0)) <= index < int(s.get("end", 0))), None)
        out.append(fallback if span is None else _as_int(span.get("version"), default))
    return out


@dataclass
class ChunkReader:
    """Reads one request's stream of chunks; `seen` counts the tokens already returned."""

    seen: int = 0

    def new_tokens(self, chunk: dict[str, Any]) -> list[tuple[int, float]]:
        meta = chunk.get("meta_info") or {}
        entries = meta.get("output_token_logprobs") or []
        total = meta.get("completion_tokens")
        if total is None or len(entries) == total:  # cumulative (SGLang's default)
            fresh = entries[self.seen :]
        elif len(entries) == total - self.seen:  # --incremental-streaming-output: a delta
            fresh = entries
        else:
            raise ValueError(
                f"chunk has {len(entries)} token logprobs; expected {total} (cumulative) or "
                f"{total - self.seen} (delta) after {self.seen}"
            )
        tokens = [(int(entry[1]), float(entry[0])) for entry in fresh]
        self.seen += len(tokens)
        return tokens
