"""Fault handling without Ray: a cell that dies mid-call, no cell left, the queue undoing a lost micro-batch.

The proxy runs in-process over scripted engines, whose next token is a pure function of the context:
a call continued on another cell from its recorded tokens must produce exactly the tokens of the
same call left alone. A `DyingCell` client behaves like a cell actor that was killed after sending
some token batches (its stream and every later call raise `CellUnavailable`).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.cells.scripted_engine import ScriptedEngine
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.clients import CellUnavailable, LocalCellClient
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.config import ProxySection
from gyre_ray.proxy.local import build_local_proxy
from gyre_ray.runtime.stream import MicroBatchStream

CODEC = ChatCodec.for_model(ModelSection())
SECTION = ProxySection(queue_timeout_s=0.5, drain_poll_s=0.02)
MESSAGES = [{"role": "user", "content": "write the parser"}]


class DyingCell(LocalCellClient):
    """A cell whose actor dies after `batches` token batches of its next stream (then stays dead)."""

    def __init__(self, inner: LocalCellClient, batches: int) -> None:
        super().__init__(inner.cell)
        self.batches = batches
        self.dead = False

    def _check(self) -> None:
        if self.dead:
            raise CellUnavailable(f"cell {self.cell_id} is unavailable: ActorDiedError")

    def generate(self, request, stream: bool = True, *session):
        return self._dying(lambda: super(DyingCell, self).generate(request, stream, *session))

    def resume(self, state, stream: bool = True, *session):
        return self._dying(lambda: super(DyingCell, self).resume(state, stream, *session))

    async def _dying(self, open_events):
        self._check()
        events, sent = open_events(), 0
        async for event in events:
            if sent == self.batches:
                self.dead = True
                await events.aclose()
                self._check()
            yield event
            sent += 1

    async def abort(self, rid: str, wait_s: float = 0.0) -> bool:
        self._check()
        return await super().abort(rid, wait_s)

    async def is_draining(self) -> bool:
        self._check()
        return await super().is_draining()

    async def status(self) -> dict:
        self._check()
        return await super().status()


def new_proxy(tmp_path):
    factory = ScriptedEngineFactory({"reply_length": 40, "token_delay_s": 0.002})
    return asyncio.run(build_local_proxy(CODEC, factory, tmp_path, section=SECTION))


async def chat(proxy, api_key: str, stream: bool) -> httpx.Response:
    transport = httpx.ASGITransport(app=proxy.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=30) as http:
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 30, "stream": stream, "temperature": 0}
        return await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}
        )


def scripted_continuation(prompt: list[int], n: int) -> list[int]:
    """What a scripted engine generates for `prompt` (n tokens at most): a re-prefilled continuation."""
    engine, out = ScriptedEngine(reply_length=40), []
    while len(out) < n:
        out.append(engine.next_token(prompt, out, CODEC.stop_ids, None))
        if out[-1] in CODEC.stop_ids:
            break
    return out


@pytest.mark.parametrize(("stream", "batches"), [(True, 3), (False, 0)])
def test_a_call_on_a_cell_that_dies_continues_elsewhere_from_its_tokens(tmp_path, stream, batches) -> None:
    proxy = new_proxy(tmp_path)
    alone = proxy.register_execution("alone")
    assert asyncio.run(chat(proxy, alone["api_key"], stream)).status_code == 200
    (reference,) = proxy.store.records("alone")
    proxy.service.router.forget("alone")

    dying = DyingCell(proxy.service.cells["cell-0"], batches=batches)
    proxy.service.cells["cell-0"] = dying
    hit = proxy.register_execution("hit")
    reply = asyncio.run(chat(proxy, hit["api_key"], stream))
    assert reply.status_code == 200, reply.text
    (record,) = proxy.store.records("hit")
    assert dying.dead and record.meta["cells"] == ["cell-0", "cell-1"]
    assert len(record.output_ids) == len(record.output_logprobs) == len(record.versions) == 30
    assert "cell-0" in proxy.service.router.drained and proxy.service.counters["cell_failures"] == 1
    if not batches:  # nothing had been generated: the call simply ran on the other cell
        assert record.output_ids == reference.output_ids and "reprefills" not in record.meta
        return
    assert record.meta["reprefills"] == 1
    out, ref = record.output_ids, reference.output_ids
    kept = next(k for k in range(len(out)) if out[k] != ref[k])  # tokens that came from the dead cell
    assert kept >= batches
    assert out[kept:] == scripted_continuation(record.input_ids + out[:kept], 30 - kept)


def test_no_live_cell_is_a_retryable_503_not_a_hang(tmp_path) -> None:
    proxy = new_proxy(tmp_path)
    for cell_id, client in list(proxy.service.cells.items()):
        proxy.service.cells[cell_id] = dead = DyingCell(client, batches=0)
        dead.dead = True
    created = proxy.register_execution()
    started = time.monotonic()
    replies = [asyncio.run(chat(proxy, created["api_key"], stream)) for stream in (False, True)]
    assert time.monotonic() - started < 2 * SECTION.queue_timeout_s + 10
    for reply in replies:
        assert reply.status_code == 503 and reply.headers["retry-after"] == str(SECTION.retry_after_s)
        assert "retry" in reply.text.lower() or "cell" in reply.text.lower()

    async def cells() -> httpx.Response:
        transport = httpx.ASGITransport(app=proxy.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            return await http.get("/gyre/cells", headers={"Authorization": f"Bearer {proxy.admin_token}"})

    listing = asyncio.run(cells())
    assert listing.status_code == 200
    assert [c["available"] for c in listing.json()["cells"]] == [False, False]


def test_untrain_puts_a_lost_micro_batch_first_in_line_and_the_step_is_incomplete_again() -> None:
    stream = MicroBatchStream()
    for i in range(3):
        stream.put(f"b{i}", [f"e{i}"])
    stream.seal()
    for cell in ("cell-1", "cell-2", "cell-1"):
        item = stream.claim(cell)
        stream.trained(item.index, cell)
    assert stream.complete
    stream.untrain(0)
    assert (
        not stream.complete and stream.queued == 1 and stream.trained_by_cell() == {"cell-1": 1, "cell-2": 1}
    )
    again = stream.claim("cell-0")
    assert again.index == 0
    stream.trained(0, "cell-0")
    assert stream.complete and stream.scale() == pytest.approx(1 / 3)
    fresh = MicroBatchStream()
    fresh.put("x", ["e"])
    with pytest.raises(RuntimeError, match="not trained"):
        fresh.untrain(0)
