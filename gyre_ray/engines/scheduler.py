"""The torch engine's scheduling state and its model steps; lives on the engine thread only.

`Scheduler.step()` is one iteration of continuous batching:

1. prefill waiting requests, up to `prefill_chunk_tokens` new tokens in all, in ONE forward: their
   new tokens side by side in a packed row, each request attending causally over its own cache
   (`gyre_ray.model.packed_kv`), so the weights are read once per round, not once per request; a
   long prompt spreads over several rounds while the running requests keep decoding; a prompt
   first takes its longest prefix from the prefix cache;
2. one decode step per decode batch: every running request feeds its last sampled token, rows
   padded to a common cache length with an explicit mask and true position ids.

A request joins the decode batch where it adds the least padding, provided every row keeps at least
1 / (1 + max_padding_ratio) of the batch width as real tokens; else it opens a new batch. Events go to an `Outbox` the engine flushes after each iteration.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from gyre_ray.engines.base import (
    ABORT_TOKEN_ID,
    GenerateResult,
    KVState,
    PrefixState,
    TokenEvent,
    UnknownRequestError,
)
from gyre_ray.engines.decode_batch import DecodeBatch
from gyre_ray.engines.prefix_cache import PrefixCache
from gyre_ray.engines.requests import ActiveRequest, Outbox
from gyre_ray.engines.sampling import sample_rows
from gyre_ray.model.kv_cache import KVCache
from gyre_ray.model.packed_kv import PackedCaches


class Scheduler:
    """Waiting requests, decode batches and the prefix cache of one engine."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int,
        prefill_chunk_tokens: int,
        max_padding_ratio: float,
        prefix_cache_tokens: int,
        version: int,
        stats: dict[str, Any],
        outbox: Outbox,
        forget: Callable[[str], None],
    ) -> None:
        """`stats` is the engine's counter dict (updated here); `forget(rid)` unregisters a request."""
        self.model = model
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_padding_ratio = max_padding_ratio
        self.prefix = PrefixCache(prefix_cache_tokens)
        self.version = version
        self.stats = stats
        self.outbox = outbox
        self.forget = forget
        self.waiting: deque[ActiveRequest] = deque()
        self.batches: list[DecodeBatch] = []

    @property
    def running(self) -> int:
        return sum(len(b) for b in self.batches)

    def has_work(self) -> bool:
        return bool(self.waiting or self.batches)

    def add(self, req: ActiveRequest) -> None:
        self.waiting.append(req)

    def set_version(self, version: int) -> None:
        """New weights are in place: later tokens carry `version`; cached KV is stale."""
        self.version = version
        self.prefix.clear()

    def step(self) -> None:
        """Admit (prefill) what fits, then one decode step for every batch."""
        self._admit()
        for batch in list(self.batches):
            self._decode(batch)

    # ------------------------------------------------------------------ leaving early
    def abort(self, rid: str) -> GenerateResult | None:
        """Stop `rid`; its partial output (None if it is not here)."""
        detached = self._detach(rid, want_cache=self.prefix.budget_tokens > 0)
        if detached is None:
            return None
        req, cache = detached
        self._cache_prefix(req, cache, owned=True)
        self._end(req, "aborted", aborted=True)
        return req.final

    def export(self, rid: str) -> KVState:
        """Stop `rid` and return everything needed to continue it elsewhere (KV as CPU tensors)."""
        detached = self._detach(rid, want_cache=True)
        if detached is None:
            raise UnknownRequestError(f"request {rid!r} is not running in this engine (unknown or finished)")
        req, cache = detached
        state = KVState(
            rid=req.rid,
            input_ids=list(req.input_ids),
            output_ids=list(req.output_ids),
            output_logprobs=list(req.output_logprobs),
            output_versions=list(req.output_versions),
            sampling=dataclasses.replace(req.sampling, seed=req.seed),
            kv=(cache if cache is not None else KVCache()).to_state(),
            rng_state=req.generator.get_state(),
            version=self.version if req.kv_version is None else req.kv_version,
        )
        self._end(req, "exported", aborted=True)
        return state

    def export_prefix(self, tokens: list[int]) -> PrefixState | None:
        """The longest cached prefix of `tokens` and its KV as CPU tensors (None when nothing is cached)."""
        hit, cache = self.prefix.match(tokens)
        if cache is None:
            return None
        self.stats["prefix_exported_tokens"] += hit
        return PrefixState(list(tokens[:hit]), cache.to_state(), self.version)

    def import_prefix(self, tokens: list[int], cache: KVCache, version: int) -> int:
        """Store another engine's prefix KV in the prefix cache; tokens added (0 when it predates our weights)."""
        if version != self.version:
            self.stats["prefix_imports_stale"] += 1
            return 0
        added = self.prefix.insert(tokens, cache, owned=True)
        self.stats["prefix_imported_tokens"] += added
        return added

    def abort_all(self) -> None:
        for req in list(self.waiting) + [r for b in self.batches for r in b.rows]:
            self._end(req, "aborted", aborted=True)
        self.waiting.clear()
        self.batches.clear()

    def _locate(self, rid: str) -> tuple[DecodeBatch | None, int]:
        for batch in self.batches:
            for index, row in enumerate(batch.rows):
                if row.rid == rid:
                    return batch, index
        for index, req in enumerate(self.waiting):
            if req.rid == rid:
                return None, index
        return None, -1

    def _detach(self, rid: str, want_cache: bool) -> tuple[ActiveRequest, KVCache | None] | None:
        """Take a running or waiting request out of the schedule, with its KV if asked."""
        batch, index = self._locate(rid)
        if index < 0:
            return None
        if batch is None:
            req = self.waiting[index]
            del self.waiting[index]
            cache, req.cache = req.cache, None
            return req, cache
        req = batch.rows[index]
        cache = batch.row_cache(index) if want_cache else None
        batch.remove([index])
        if not batch:
            self.batches.remove(batch)
        return req, cache

    # ------------------------------------------------------------------ bookkeeping
    def _end(self, req: ActiveRequest, counter: str, aborted: bool = False) -> None:
        if aborted:
            req.finish_reason = "abort"
        req.final = req.result()
        self.forget(req.rid)
        self.stats[counter] += 1
        if aborted:
            self.outbox.put(req.sink, TokenEvent(req.rid, ABORT_TOKEN_ID, 0.0, self.version, "abort"))

    def _fail(self, req: ActiveRequest, exc: Exception) -> None:
        req.finish_reason = "abort"
        req.final = req.result()
        self.forget(req.rid)
        self.stats["failed"] += 1
        self.outbox.put(req.sink, exc)

    def _cache_prefix(self, req: ActiveRequest, cache: KVCache | None, owned: bool = False) -> None:
        """Offer a request's KV to the prefix cache, unless part of it predates the current weights.

        `owned`: `cache` is not used afterwards (the tree may keep views of it instead of a copy)."""
        if (
            req.kv_version == self.version
            and cache is not None
            and cache.length
            and self.prefix.budget_tokens
        ):
            self.prefix.insert(req.context[: cache.length], cache, owned=owned)

    # ------------------------------------------------------------------ model steps
    def _admit(self) -> None:
        """Prefill the waiting requests that fit this round's token budget in one packed forward."""
        budget = self.prefill_chunk_tokens
        slots = self.max_batch_size - self.running
        group: list[tuple[ActiveRequest, int, int]] = []  # (request, first, last + 1 context position)
        for req in self.waiting:
            if budget <= 0 or len(group) >= slots:
                break
            start, target = self._prepare(req)
            stop = min(target, start + budget)
            group.append((req, start, stop))
            budget -= stop - start
        if not group:
            return
        try:
            events = self._prefill(group)
        except Exception as exc:  # these requests fail (their caches are as before); the others go on
            for req, _, _ in group:
                self.waiting.remove(req)
                self._fail(req, exc)
            return
        for req, _, _ in group:
            if req.kv_length < req.kv_target:
                continue  # budget spent inside this prompt: continue it next round
            self.waiting.remove(req)
            if req.finish_reason is not None:  # the first token already ended it
                req.cache = None
                self._end(req, "finished")
            else:
                self._join(req)
            event = events.get(req.rid)
            if event is not None:
                self.outbox.put(req.sink, event)

    def _prepare(self, req: ActiveRequest) -> tuple[int, int]:
        """Give `req` its cache (from the prefix cache where it can); (positions computed, positions needed)."""
        if req.kv_version is None:
            req.kv_version = self.version
        target = req.kv_target if req.output_ids else len(req.input_ids)
        if req.cache is None:
            req.cache = KVCache()
        if not req.prefix_looked_up:
            req.prefix_looked_up = True
            limit = req.kv_target if req.output_ids else len(req.input_ids) - 1
            hit, cache = self.prefix.match(req.context, limit, capacity=target)
            if cache is not None:
                req.cache, req.cached_tokens = cache, hit
                self.stats["prefix_cached_tokens"] += hit
        return req.cache.length, target

    def _prefill(self, group: list[tuple[ActiveRequest, int, int]]) -> dict[str, TokenEvent]:
        """One forward over the new tokens of every request in `group`; first tokens of finished prompts."""
        work = [(req, start, stop) for req, start, stop in group if stop > start]
        if not work:
            return {}
        ids, positions = [], []
        for req, start, stop in work:
            req.cache.reserve(req.kv_target if req.output_ids else len(req.input_ids))
            ids.extend(req.context[start:stop])
            positions.extend(range(start, stop))
        packed = PackedCaches(
            [req.cache for req, _, _ in work],
            [stop - start for _, start, stop in work],
            self.device,
            self.model.args.num_attention_heads,
        )
        hidden = self.model.hidden_states(
            torch.tensor([ids], dtype=torch.long, device=self.device),
            torch.tensor([positions], dtype=torch.long, device=self.device),
            None,
            packed,
        )
        self.stats["prefill_computed_tokens"] += packed.tokens
        done = [
            i for i, (req, _, stop) in enumerate(work) if stop == len(req.input_ids) and not req.output_ids
        ]
        if not done:
            return {}
        columns = torch.tensor([packed.last_columns()[i] for i in done], device=self.device)
        logits = self.model.logits(hidden[0, columns])
        rows = [work[i][0] for i in done]
        tokens, logprobs = sample_rows(logits, [r.sampling for r in rows], [r.generator for r in rows])
        events = {}
        for req, token, logprob in zip(rows, tokens, logprobs, strict=True):
            self._cache_prefix(req, req.cache)
            self.stats["decode_tokens"] += 1
            events[req.rid] = event = req.add_token(token, logprob, self.version)
            event.cached_tokens = min(req.cached_tokens, len(req.input_ids))
        return events

    def _join(self, req: ActiveRequest) -> None:
        cache, req.cache = req.cache, None
        assert cache is not None
        best, best_padding = None, None
        for batch in self.batches:
            padding = batch.join_cost(cache.length, self.max_padding_ratio)
            if padding is not None and (best_padding is None or padding < best_padding):
                best, best_padding = batch, padding
        if best is None:
            best = DecodeBatch(self.device)
            self.batches.append(best)
        best.add(req, cache)

    def _decode(self, batch: DecodeBatch) -> None:
        tokens, positions, mask = batch.step_inputs()
        try:
            logits = self.model(tokens, positions, mask, batch.cache)[:, -1]
        except Exception as exc:  # the cache is left as it was; these rows fail, others go on
            for req in batch.rows:
                self._fail(req, exc)
            self.batches.remove(batch)
            return
        batch.after_step()
        rows = list(batch.rows)
        sampled, logprobs = sample_rows(logits, [r.sampling for r in rows], [r.generator for r in rows])
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(rows)
        finished, events = [], []
        for index, (req, token, logprob) in enumerate(zip(rows, sampled, logprobs, strict=True)):
            events.append(req.add_token(token, logprob, self.version))
            if req.finish_reason is not None:
                finished.append(index)
                if self.prefix.budget_tokens and req.kv_version == self.version:
                    self._cache_prefix(req, batch.row_cache(index), owned=True)
        batch.remove(finished)
        if not batch:
            self.batches.remove(batch)
        for req, event in zip(rows, events, strict=True):
            if event.finish_reason is not None:
                self._end(req, "finished")  # bookkeeping first: a caller woken by the event sees it
            self.outbox.put(req.sink, event)
