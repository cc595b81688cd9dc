"""What keeps the proxy's own overhead low without changing behaviour, in-process (no Ray).

Proves: the segment cache renders exactly the ids a fresh encode gives and stays within its bound;
records handed to the store in batches after the response are still complete whenever they are read
(records, finish, stats) and arrive in call order, a batch per event-loop turn; a cell sends a
stream's intermediate tokens at most once per interval but never holds back its first or last
tokens; a call cancelled while it waits for tokens (Serve's direct ingress cancels a request whose
client went away) aborts its request on the cell, and the partial call is recorded only once the
cell has let go of it.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
from asgi_scope import json_post_scope

from gyre_ray.cells.cell import RolloutCell, TokenBatch
from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.engines.base import GenerateRequest, SamplingParams
from gyre_ray.model.chat_template import encode_chat
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.clients import LocalStoreClient
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.local import build_local_proxy
from gyre_ray.proxy.prompt import ChatPrompt

CODEC = ChatCodec.for_model(ModelSection())
WORDS = ["the", "tool", "call", "returns", "a", "file", "path", "über", "naïve", "日本", "\n", "  ", "{}"]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ---- segment cache ----------------------------------------------------------------------------------
def test_cached_prompt_ids_equal_a_fresh_encode_and_the_cache_stays_bounded():
    codec = ChatCodec(CODEC.tokenizer, CODEC.context_length, segment_cache_ids=800)
    rng = random.Random(7)
    system = {"role": "system", "content": _text(rng, 300)}
    history: list[dict] = [system]
    for _turn in range(12):
        history.append({"role": "user", "content": _text(rng, rng.randint(1, 80))})
        prompt = ChatPrompt(messages=[dict(m) for m in history])  # new string objects every call
        splice = {i: [400 + i, 401] for i, m in enumerate(history) if m["role"] == "assistant" and i % 4 == 0}
        expected = encode_chat(codec.tokenizer, prompt.messages, None, True, splice)
        assert codec.prompt_ids(prompt, splice) == expected
        assert codec.prompt_ids(prompt, splice) == expected  # all hits now
        assert 0 < codec.segments.ids <= 800
        history.append({"role": "assistant", "content": _text(rng, rng.randint(1, 40))})
    assert codec.segments.hits > codec.segments.misses


# ---- batched recording --------------------------------------------------------------------------------
class BatchingStore(LocalStoreClient):
    """The in-process store, handed records the way the Serve replica hands them to the store actor."""

    batched = True

    def __init__(self, store) -> None:
        super().__init__(store)
        self.batches: list[int] = []

    def submit(self, method: str, *args) -> None:
        if method == "add_many":
            self.batches.append(len(args[0]))
        super().submit(method, *args)


def _chat(messages, stream=False):
    return {"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0, "stream": stream}


def test_records_batched_after_the_response_are_complete_whenever_read(tmp_path):
    async def main():
        proxy = await build_local_proxy(CODEC, ScriptedEngineFactory({"reply_length": 6}), tmp_path)
        store = BatchingStore(proxy.store)
        proxy.service.store = store
        admin = {"Authorization": f"Bearer {proxy.admin_token}"}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=proxy.app), base_url="http://p"
        ) as http:
            created = (await http.post("/gyre/executions", headers=admin, json={})).json()
            key = {"Authorization": f"Bearer {created['api_key']}"}
            first = await http.post(
                "/v1/chat/completions", headers=key, json=_chat([{"role": "user", "content": "a"}])
            )
            assert first.status_code == 200
            # straight after the response: read through the proxy, which flushes what is pending
            lines = (
                await http.get(f"/gyre/executions/{created['execution_id']}/records", headers=admin)
            ).text
            assert [json.loads(line)["call_id"] for line in lines.splitlines()] == [first.json()["id"][9:]]

            many = await asyncio.gather(
                *(
                    http.post(
                        "/v1/chat/completions",
                        headers=key,
                        json=_chat([{"role": "user", "content": f"q{i}"}], i % 2 == 1),
                    )
                    for i in range(8)
                )
            )
            assert all(r.status_code == 200 for r in many)
            stats = (await http.get("/gyre/stats", headers=admin)).json()
            assert stats["store"]["records_in_memory"] == 9 and stats["store"]["rejected_records"] == 0
            finished = await http.post(f"/gyre/executions/{created['execution_id']}/finish", headers=admin)
            assert finished.status_code == 200
        records = proxy.store.records(created["execution_id"])
        assert len(records) == 9 and sum(store.batches) == 9
        assert len(store.batches) < 9  # calls that end in the same loop turn share one store call
        assert records[0].call_id == first.json()["id"][9:]  # in the order the proxy recorded them
        for cell in proxy.cells.values():
            cell.close()

    asyncio.run(main())


def test_a_batch_with_a_record_of_an_unknown_execution_keeps_the_others(tmp_path):
    from gyre_ray.proxy.store import TrajectoryStore
    from gyre_ray.trajectory.records import CallRecord

    store = TrajectoryStore(tmp_path)
    known = store.register("known")["execution_id"]

    def record(execution_id: str, i: int) -> CallRecord:
        return CallRecord(execution_id, f"call-{i}", "main", [1, 2], [3], [-0.1], [0], 1.0, 2.0)

    store.add_many([(record(known, 0), "k0"), (record("gone", 1), None), (record(known, 2), None)])
    assert [r.call_id for r in store.records(known)] == ["call-0", "call-2"]
    assert store.find_outputs(known, ["k0"]) == {"k0": ("call-0", [3])}
    assert store.stats()["rejected_records"] == 1


# ---- cells: stream interval, abort that waits -------------------------------------------------------
def _request(rid: str, max_new: int) -> GenerateRequest:
    return GenerateRequest(
        rid, list(range(300, 320)), SamplingParams(temperature=0.0, max_new_tokens=max_new)
    )


async def _batches(cell: RolloutCell, rid: str, max_new: int) -> list[TokenBatch]:
    return [b async for b in cell.generate(_request(rid, max_new)) if isinstance(b, TokenBatch)]


def test_a_stream_interval_batches_intermediate_tokens_but_never_the_first_or_last():
    async def main():
        factory = ScriptedEngineFactory({"token_delay_s": 0.005, "reply_length": 100})
        plain, paced = RolloutCell("a", factory), RolloutCell("b", factory, stream_interval_s=0.04)
        await plain.setup()
        await paced.setup()
        expected = await _batches(plain, "r", 24)
        got = await _batches(paced, "r", 24)
        tokens = [[e.token_id for b in batches for e in b.events] for batches in (expected, got)]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 24
        assert len(expected) >= 20 and len(got) <= 8  # ~120 ms of tokens, one batch per 40 ms
        assert len(got[0].events) == 1  # the first token is not held back
        assert got[-1].events[-1].finish_reason == "length" and got[-1].engine_seconds is not None

    asyncio.run(main())


def test_abort_can_wait_until_the_request_has_left_the_cell():
    async def main():
        cell = RolloutCell("a", ScriptedEngineFactory({"token_delay_s": 0.05, "reply_length": 100}))
        await cell.setup()
        stream = cell.generate(_request("r", 50))
        first = await stream.__anext__()
        assert isinstance(first, TokenBatch) and cell.status()["inflight"] == 1
        consumer = asyncio.ensure_future(_drain(stream))
        assert await cell.abort("r", wait_s=5.0)
        assert cell.status()["inflight"] == 0
        await consumer
        assert not await cell.abort("r")

    asyncio.run(main())


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_a_call_cancelled_while_waiting_for_tokens_aborts_its_cell_before_it_is_recorded(tmp_path):
    async def main():
        factory = ScriptedEngineFactory({"token_delay_s": 0.05, "reply_length": 200})
        proxy = await build_local_proxy(CODEC, factory, tmp_path)
        created = proxy.register_execution()
        key = {"Authorization": f"Bearer {created['api_key']}"}
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 150,
            "stream": True,
        }
        app = proxy.app
        chunks = 0
        got_some = asyncio.Event()

        async def receive():
            await asyncio.Event().wait()  # the client never says more (nor disconnects by itself)

        async def send(message):
            nonlocal chunks
            if message["type"] == "http.response.body" and message.get("body"):
                chunks += 1
                if chunks >= 3:
                    got_some.set()

        raw = json.dumps(body).encode()
        scope = json_post_scope("/v1/chat/completions", {"content-length": str(len(raw)), **key})
        sent = False

        async def receive_once():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        request = asyncio.ensure_future(app(scope, receive_once, send))
        await asyncio.wait_for(got_some.wait(), 30)
        request.cancel()  # what Serve's direct ingress does when the client goes away
        for _ in range(200):  # the partial call is recorded once the cell has let go of it
            if proxy.store.records(created["execution_id"]):
                break
            await asyncio.sleep(0.01)
        records = proxy.store.records(created["execution_id"])
        assert len(records) == 1 and records[0].meta["client_disconnected"]
        assert 0 < len(records[0].output_ids) < 150
        assert all(cell.status()["inflight"] == 0 for cell in proxy.cells.values())
        for cell in proxy.cells.values():
            cell.close()

    asyncio.run(main())
