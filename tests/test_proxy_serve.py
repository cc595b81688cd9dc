"""The proxy on Ray Serve in front of two tiny-model rollout cells (placement groups), over real HTTP.

One local Ray + Serve for the whole module. Proves: the cells are placement groups with one engine
actor each; the official SDKs work against the tiny model, streaming and not, and every call is
recorded with the exact prompt and output ids; draining a cell under 8 live streams moves them with
their KV state to the other cell, where they finish exactly as an undisturbed greedy run would,
without recomputing any prefix token.
"""

from __future__ import annotations

import threading
import time

import anthropic
import openai
import pytest
import ray

from gyre_ray.config import load_config
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.launch import start_proxy
from gyre_ray.proxy.prompt import ChatPrompt
from gyre_ray.runtime.cluster import start_local_ray

CODEC = ChatCodec.for_model(ModelSection())
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from ray import serve

    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    records = tmp_path_factory.mktemp("records")
    config = load_config(
        None,
        [
            "cells.num_cells=2",
            "cells.cpus_per_cell=0.5",
            "proxy.port=0",
            f"proxy.records_dir={records}",
            f"proxy.max_output_tokens={MAX_TOKENS}",
        ],
    )
    handle = start_proxy(config, timeout_s=180)
    yield handle
    handle.shutdown()
    serve.shutdown()
    ray.shutdown()


def test_cells_are_bundles_of_a_placement_group_hosting_one_engine_each(served):
    from ray.util import placement_group_table

    groups = [
        g for g in placement_group_table().values() if g["name"].endswith("-pg") and g["state"] == "CREATED"
    ]
    assert any(len(g["bundles"]) == 2 for g in groups), groups  # one bundle per cell
    cells = served.cells()
    assert [c["cell_id"] for c in cells] == ["cell-0", "cell-1"]
    assert all(c["role"] == "rollout" and c["routable"] and c["engine"]["weights_loaded"] for c in cells)


def test_sdks_against_the_tiny_model_record_exact_tokens(served):
    created = served.register_execution()
    key = created["api_key"]
    oa = openai.OpenAI(api_key=key, base_url=served.openai_base_url, max_retries=0, timeout=120)
    an = anthropic.Anthropic(api_key=key, base_url=served.base_url, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Say something."}]

    full = oa.chat.completions.create(model="whatever", messages=messages, temperature=0, max_tokens=12)
    streamed = oa.chat.completions.create(
        model="whatever", messages=messages, temperature=0, max_tokens=12, stream=True
    )
    streamed_text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    greedy = {"temperature": 0}  # this SDK version has no temperature argument; the API still takes it
    msg = an.messages.create(model="claude-x", max_tokens=12, messages=messages, extra_body=greedy)
    with an.messages.stream(model="claude-x", max_tokens=12, messages=messages, extra_body=greedy) as stream:
        anthropic_streamed = "".join(stream.text_stream)

    texts = [full.choices[0].message.content, streamed_text, msg.content[0].text, anthropic_streamed]
    assert len(set(texts)) == 1  # greedy: the same answer whichever API and transport
    records = served.records(created["execution_id"])
    assert [r.meta["api"] for r in records] == [
        "openai-chat",
        "openai-chat",
        "anthropic-messages",
        "anthropic-messages",
    ]
    expected_prompt = CODEC.prompt_ids(ChatPrompt(messages=messages))
    for record, text in zip(records, texts, strict=True):
        assert record.input_ids == expected_prompt
        shown = [t for t in record.output_ids if t not in CODEC.stop_ids]
        assert CODEC.decode(shown) == text
        assert all(lp <= 0 for lp in record.output_logprobs) and set(record.versions) == {0}


def _stream_all(served, prompts, key, started_after=None):
    """Run one streaming chat call per prompt in threads; returns (texts, started events, threads, errors)."""
    client = openai.OpenAI(api_key=key, base_url=served.openai_base_url, max_retries=0, timeout=180)
    texts = [""] * len(prompts)
    started = [threading.Event() for _ in prompts]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            stream = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": prompts[i]}],
                temperature=0,
                max_tokens=MAX_TOKENS,
                stream=True,
            )
            chunks = 0
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    texts[i] += chunk.choices[0].delta.content
                    chunks += 1
                    if started_after is not None and chunks >= started_after:
                        started[i].set()
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            started[i].set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    return texts, started, threads, errors


def test_draining_a_cell_under_8_streams_moves_them_with_their_kv(served):
    prompts = [f"Stream number {i}: tell me a long story about cells." for i in range(8)]

    reference_exec = served.register_execution()
    ref_texts, _, threads, errors = _stream_all(served, prompts, reference_exec["api_key"])
    for thread in threads:
        thread.join(timeout=180)
    assert not errors
    reference = {r.input_ids[-20:].__repr__(): r for r in served.records(reference_exec["execution_id"])}
    assert all(len(r.output_ids) == MAX_TOKENS for r in reference.values())  # none ends before the drain

    moved_exec = served.register_execution()
    texts, started, threads, errors = _stream_all(served, prompts, moved_exec["api_key"], started_after=2)
    for event in started:
        assert event.wait(timeout=120)
    cells = {c["cell_id"]: c for c in served.cells()}
    source = max(cells, key=lambda cid: cells[cid]["inflight"])
    target = next(cid for cid in cells if cid != source)
    assert cells[source]["inflight"] == 8
    before = cells[target]["engine"]
    moved = served.drain(source)
    for thread in threads:
        thread.join(timeout=180)
    after = {c["cell_id"]: c for c in served.cells()}[target]["engine"]
    served.undrain(source)

    assert not errors and moved == 8
    assert texts == ref_texts  # greedy outputs equal the undisturbed run
    records = served.records(moved_exec["execution_id"])
    assert len(records) == 8
    for record in records:
        assert record.meta["cells"] == [source, target] and record.meta["migrations"] == 1
        assert record.output_ids == reference[record.input_ids[-20:].__repr__()].output_ids
    assert after["prefill_computed_tokens"] == before["prefill_computed_tokens"]  # no prefix recomputed
    assert after["imported"] - before["imported"] == 8
    assert after["imported_tokens"] - before["imported_tokens"] >= sum(len(r.input_ids) for r in records)


def test_a_drained_cell_takes_no_new_calls_until_undrained(served):
    created = served.register_execution()
    client = openai.OpenAI(
        api_key=created["api_key"], base_url=served.openai_base_url, max_retries=0, timeout=60
    )
    served.drain("cell-0")
    try:
        for _ in range(3):
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    finally:
        served.undrain("cell-0")
    assert {tuple(r.meta["cells"]) for r in served.records(created["execution_id"])} == {("cell-1",)}
    time.sleep(0.1)
    assert all(c["routable"] for c in served.cells())


def test_a_client_that_goes_away_mid_stream_aborts_its_call_which_is_still_recorded(served):
    import httpx

    created = served.register_execution()
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {created['api_key']}"}
    with (
        httpx.Client(base_url=served.base_url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
    ):
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 60
    records = []
    while time.monotonic() < deadline and not records:
        records = served.records(created["execution_id"])
        time.sleep(0.2)
    assert len(records) == 1
    record = records[0]
    assert record.meta["client_disconnected"] and 0 < len(record.output_ids) < MAX_TOKENS
    assert all(c["inflight"] == 0 for c in served.cells())


def test_direct_ingress_and_serves_http_proxy_reach_the_same_app(served):
    import httpx

    assert served.base_url != served.serve_url  # the replica's own port (direct ingress) and Serve's proxy
    created = served.register_execution()
    headers = {"Authorization": f"Bearer {created['api_key']}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    ids = []
    for url in (served.base_url, served.serve_url):
        with httpx.Client(base_url=url, timeout=120) as client:
            assert client.get("/gyre/health").status_code == 200
            reply = client.post("/v1/chat/completions", json=body, headers=headers)
            assert reply.status_code == 200, reply.text
            ids.append(reply.json()["id"].removeprefix("chatcmpl-"))
    records = served.records(created["execution_id"])  # read at once: batched records are all there
    assert [r.call_id for r in records] == ids
    assert records[0].output_ids == records[1].output_ids  # same greedy reply either way


def test_admin_errors_from_the_store_actor_reach_the_client_as_one_line(served):
    """The store runs as a Ray actor: its errors come back wrapped with the actor's traceback, which
    must not reach the HTTP client (only the store's own message, with the right status)."""
    import httpx

    admin = {"Authorization": f"Bearer {served.admin_token}"}
    taken = served.register_execution()["execution_id"]
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        replies = {
            "records": client.get("/gyre/executions/nope/records", headers=admin),
            "finish": client.post("/gyre/executions/nope/finish", headers=admin),
            "again": client.post("/gyre/executions", json={"execution_id": taken}, headers=admin),
            "bad id": client.post("/gyre/executions", json={"execution_id": "../x"}, headers=admin),
        }
    assert {name: r.status_code for name, r in replies.items()} == {
        "records": 404, "finish": 404, "again": 409, "bad id": 400,
    }  # fmt: skip
    for name, reply in replies.items():
        message = reply.json()["error"]["message"]
        assert "Traceback" not in message and "ray::" not in message and "\n" not in message, (name, message)
    assert "nope" in replies["records"].json()["error"]["message"]


def test_a_closed_executions_key_is_refused_through_serve(served):
    """`close` reaches the store actor through Serve: after it, the execution's key is refused, and an
    unknown execution's close is a one-line 404 like the other admin errors."""
    import httpx

    created = served.register_execution()
    mine = {"Authorization": f"Bearer {created['api_key']}"}
    admin = {"Authorization": f"Bearer {served.admin_token}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=served.base_url, timeout=120) as client:
        assert client.post("/v1/chat/completions", json=body, headers=mine).status_code == 200
        closed = client.post(f"/gyre/executions/{created['execution_id']}/close", headers=mine)
        late = client.post("/v1/chat/completions", json=body, headers=mine)
        unknown = client.post("/gyre/executions/nope/close", headers=admin)
    assert closed.status_code == 200 and closed.json()["records"] == 1
    assert late.status_code == 401 and "has ended (its key is revoked)" in late.json()["error"]["message"]
    assert unknown.status_code == 404 and "\n" not in unknown.json()["error"]["message"]
