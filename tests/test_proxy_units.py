"""Pure parts of the proxy: routing, role rules, incremental text, request translation, the store."""

from __future__ import annotations

import json

import pytest

from gyre_ray.proxy.anthropic_schema import MessagesRequest
from gyre_ray.proxy.errors import ApiError, error_body
from gyre_ray.proxy.front import validate
from gyre_ray.proxy.openai_schema import ChatCompletionRequest
from gyre_ray.proxy.prompt import ChatPrompt, assistant_key
from gyre_ray.proxy.roles import RoleError, classify_role, system_fingerprint
from gyre_ray.proxy.router import Router
from gyre_ray.proxy.store import StoreError, TrajectoryStore
from gyre_ray.proxy.textgen import TextAssembler
from gyre_ray.trajectory.records import CallRecord, read_jsonl


# ---- router ----------------------------------------------------------------------------------------
def test_router_keeps_an_execution_on_its_cell_and_spreads_new_ones_by_load():
    router = Router(["a", "b"])
    first = router.choose("e1")
    router.started(first)
    second = router.choose("e2")
    assert second != first  # least loaded
    for _ in range(3):
        assert router.choose("e1") == first  # affinity even though `first` is busier
    router.finished(first)


def test_router_skips_drained_cells_and_repins():
    router = Router(["a", "b"])
    pinned = router.choose("e1")
    router.drain(pinned)
    other = router.choose("e1")
    assert other != pinned and router.affinity["e1"] == other
    router.drain(other)
    assert router.choose("e1") is None
    router.undrain(pinned)
    assert router.choose("e1") == pinned
    with pytest.raises(KeyError, match="unknown cell"):
        router.drain("zzz")


# ---- roles -------------------------------------------------------------------------------------------
def _prompt(system: str, user: str) -> ChatPrompt:
    return ChatPrompt(messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])


def test_role_header_wins_and_must_be_known():
    assert classify_role(_prompt("s", "u"), header="sub-agent-summary") == "sub-agent-summary"
    with pytest.raises(RoleError, match="not one of"):
        classify_role(_prompt("s", "u"), header="boss")


def test_claude_code_subagent_and_compaction_rules():
    main_sys = (
        "x-anthropic-billing-header: cc_version=1.2.abc; cc_entrypoint=sdk-cli;\nYou are a Claude agent."
    )
    sub_sys = "x-anthropic-billing-header: cc_version=1.2.def; cc_is_subagent=true;\nYou are a Claude agent."
    ua = "claude-cli/2.1.197 (external, sdk-cli)"
    assert classify_role(_prompt(main_sys, "fix the bug"), user_agent=ua) == "main"
    assert classify_role(_prompt(sub_sys, "find files"), user_agent=ua) == "sub-agent"
    ask = "Your task is to create a detailed summary of the conversation so far."
    assert classify_role(_prompt(main_sys, ask), user_agent=ua) == "main-summary"
    assert classify_role(_prompt(sub_sys, ask), user_agent=ua) == "sub-agent-summary"


def test_generic_rule_other_system_prompt_is_a_subagent():
    main = _prompt("You are the main agent.", "task")
    fingerprint = system_fingerprint(main)
    assert classify_role(main, main_fingerprint=fingerprint) == "main"
    assert (
        classify_role(_prompt("You are a helper.", "sub task"), main_fingerprint=fingerprint) == "sub-agent"
    )
    summary = _prompt("You are the main agent.", "Please summarize the conversation so far.")
    assert classify_role(summary, main_fingerprint=fingerprint) == "main-summary"
    # A summariser prompt of its own may compact main's history or a sub-agent's: left to the tree.
    own = _prompt("You summarize conversations.", "<history>\nSummarize the conversation so far.")
    assert classify_role(own, main_fingerprint=fingerprint) == "unknown"


def test_fingerprint_ignores_the_per_request_billing_header():
    a = _prompt("x-anthropic-billing-header: cc_version=1.abc;\nSame prompt", "u")
    b = _prompt("x-anthropic-billing-header: cc_version=1.xyz;\nSame prompt", "u")
    assert system_fingerprint(a) == system_fingerprint(b) != ""


# ---- incremental text ---------------------------------------------------------------------------------
def _assembler(stops=None, markers=None):
    table = {i: ch for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz<>_ ", start=10)}
    return TextAssembler(lambda ids: "".join(table[i] for i in ids), {0}, stops, markers), {
        v: k for k, v in table.items()
    }


def test_text_assembler_holds_back_a_possible_stop_string_then_stops():
    asm, ids = _assembler(stops=["xyz"])
    out = asm.feed([ids[c] for c in "abcx"])
    assert out == "abc"  # "x" might start the stop string
    out += asm.feed([ids["y"], ids["z"], ids["q"]])
    assert asm.stopped and asm.stop_string == "xyz"
    assert out + asm.finish() == "abc"


def test_text_assembler_withholds_tool_call_markup_and_drops_stop_ids():
    asm, ids = _assembler(markers=["<t>"])
    shown = asm.feed([ids[c] for c in "hi <"]) + asm.feed([ids["t"], ids[">"], ids["x"], 0])
    shown += asm.finish()
    assert shown == "hi " and asm.content == "hi " and asm.tail == "<t>x"


def test_text_assembler_holds_trailing_whitespace_only_while_watching_for_tool_calls():
    plain, ids = _assembler()
    assert plain.feed([ids[c] for c in "hi  "]) == "hi  "  # a plain stream shows spaces as they come
    watching, ids = _assembler(markers=["<t>"])
    assert watching.feed([ids[c] for c in "hi  "]) == "hi"  # they may be the separator before a call
    assert watching.feed([ids["x"]]) == "  x"


def test_text_assembler_waits_for_incomplete_utf8():
    pieces = {1: "h", 2: "\ufffd", 3: "é"}

    def decode(ids):  # ids [2, 3] decode together to "é" (two halves of one character)
        return "é" if ids == [2, 3] else "".join(pieces[i] for i in ids)

    asm = TextAssembler(decode, set())
    assert asm.feed([1]) == "h"
    assert asm.feed([2]) == ""
    assert asm.feed([3]) == "é"


# ---- request translation ------------------------------------------------------------------------------
def test_openai_tools_and_tool_results_translate_to_chat_messages():
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"q": 1}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "get"}},
    }
    prompt = validate(ChatCompletionRequest, body).to_prompt()
    assert [m["role"] for m in prompt.messages] == ["system", "user", "assistant", "tool"]
    assert prompt.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"q": 1}'
    assert prompt.tools[0]["function"]["name"] == "get" and prompt.parse_tools


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 3}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tool name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "object",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_openai_bad_bodies_are_400s_naming_the_field(patch, needle):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **patch}
    with pytest.raises(ApiError) as info:
        validate(ChatCompletionRequest, body).to_prompt()
    assert info.value.status == 400 and needle in info.value.message


def test_anthropic_claude_code_shapes_translate():
    body = {
        "model": "claude-opus-4-8",
        "max_tokens": 64000,
        "system": [
            {"type": "text", "text": "sys A"},
            {"type": "text", "text": "sys B", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            },
            {"role": "system", "content": "mid-list system"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"cmd": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "a.txt"}],
                    },
                    {"type": "text", "text": "next"},
                ],
            },
        ],
        "tools": [
            {"name": "Bash", "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
        ],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": []},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "sess-1"})},
        "stream": True,
    }
    req = validate(MessagesRequest, body)
    prompt = req.to_prompt()
    assert [m["role"] for m in prompt.messages] == ["system", "user", "system", "assistant", "tool", "user"]
    assert prompt.messages[0]["content"] == "sys A\nsys B"
    assert json.loads(prompt.messages[3]["tool_calls"][0]["function"]["arguments"]) == {"cmd": "ls"}
    assert prompt.messages[4] == {"role": "tool", "tool_call_id": "t1", "content": "a.txt"}
    assert req.session_id() == "sess-1"


def test_assistant_key_ignores_argument_formatting_and_outer_whitespace():
    a = assistant_key("  hi\n", [{"function": {"name": "f", "arguments": '{"b": 1, "a": [1,2]}'}}])
    b = assistant_key("hi", [{"function": {"name": "f", "arguments": {"a": [1, 2], "b": 1}}}])
    assert a == b
    assert a != assistant_key("hi", [{"function": {"name": "g", "arguments": {}}}])


def test_error_shapes_per_api():
    assert error_body("openai", 401, "no")["error"]["type"] == "authentication_error"
    anthropic = error_body("anthropic", 429, "slow down")
    assert anthropic == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}


# ---- store ---------------------------------------------------------------------------------------------
def _record(execution_id: str, i: int) -> CallRecord:
    return CallRecord(
        execution_id, f"call-{i}", "main", [1, 2, i + 3], [7, 8], [-0.1, -0.2], [0, 0], 1.0, 2.0
    )


def test_store_spills_under_memory_pressure_and_reads_back_in_order(tmp_path):
    store = TrajectoryStore(tmp_path, max_records_in_memory=4)
    a = store.register("exec-a")["execution_id"]
    b = store.register("exec-b")["execution_id"]
    for i in range(5):
        store.add(_record(a, i))
    store.add(_record(b, 0))
    assert store.stats()["records_in_memory"] <= 4
    assert [r.call_id for r in store.records(a)] == [f"call-{i}" for i in range(5)]
    path = store.finish_execution(a)
    assert [r.call_id for r in read_jsonl(path)] == [f"call-{i}" for i in range(5)]
    assert store.stats()["records_in_memory"] == 1


def test_store_keys_ids_and_splice_index(tmp_path):
    store = TrajectoryStore(tmp_path)
    created = store.register()
    assert store.execution_for_key(created["api_key"]) == created["execution_id"]
    assert store.execution_for_key("gyre-nope") is None
    with pytest.raises(StoreError, match="already registered"):
        store.register(created["execution_id"])
    with pytest.raises(StoreError, match="must match"):
        store.register("../etc/passwd")
    store.add(_record(created["execution_id"], 0), splice_key="k")
    assert store.find_outputs(created["execution_id"], ["k", "other"]) == {"k": ("call-0", [7, 8])}
