"""ChatML rendering with tools, per-message segments, token splicing, and the tool-call parser."""

from __future__ import annotations

import json

import pytest

from gyre_ray.model.chat_template import (
    encode_chat,
    parse_assistant_output,
    render,
    render_jinja,
    render_segments,
)
from gyre_ray.model.tokenizer import ASSETS, Tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a shell command. Ünïcode kept as is.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {"name": "Read", "description": "Read a file", "parameters": {"type": "object", "properties": {}}},
]
CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": [{"type": "text", "text": "List the "}, {"type": "text", "text": "files."}]},
    {
        "role": "assistant",
        "content": "Listing.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}},
            {"id": "c2", "type": "function", "function": {"name": "Read", "arguments": {"path": "a.py"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"},
    {"role": "tool", "tool_call_id": "c2", "content": "print(1)"},
    {"role": "system", "content": "Reminder: be brief."},
    {"role": "assistant", "content": "Two files."},
]


def test_render_with_tools_tool_calls_and_tool_results():
    text = render(CONVERSATION, TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    tool_lines = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].split("\n")
    assert [json.loads(line)["function"]["name"] for line in tool_lines] == ["Bash", "Read"]
    assert "Ünïcode" in text  # not escaped
    assert (
        "<|im_start|>assistant\nListing.\n<tool_call>\n"
        '{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "Read", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>\n'
    ) in text
    # consecutive tool results share one user turn
    assert (
        "<|im_start|>user\n<tool_response>\na.py\nb.py\n</tool_response>\n"
        "<tool_response>\nprint(1)\n</tool_response><|im_end|>\n"
    ) in text
    assert "<|im_start|>system\nReminder: be brief.<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\nTwo files.<|im_end|>\n<|im_start|>assistant\n")
    assert not render(CONVERSATION, TOOLS, add_generation_prompt=False).endswith("<|im_start|>assistant\n")


def test_tools_without_system_message_get_their_own_system_turn():
    text = render([{"role": "user", "content": "hi"}], TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert (
        render([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_shipped_jinja_template_renders_the_same_text():
    template = Tokenizer.default().chat_template
    assert template == (ASSETS / "chat_template.jinja").read_text()
    null_arguments = [  # absent or null arguments: {} in both (the Python side wrote null)
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": None}},
            {"id": "c2", "type": "function", "function": {"name": "Read"}},
        ]},
    ]  # fmt: skip
    assert '"arguments": {}}' in render(null_arguments, TOOLS)
    for messages, tools in [
        (CONVERSATION, TOOLS), (CONVERSATION[1:], TOOLS), (CONVERSATION, None), (null_arguments, TOOLS)
    ]:  # fmt: skip
        for gen in (True, False):
            assert render_jinja(template, messages, tools, gen) == render(messages, tools, gen)
    import transformers  # a dev dependency (the HF reference): never skipped

    hf_tok = transformers.AutoTokenizer.from_pretrained(ASSETS)
    assert hf_tok.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    ) == render(CONVERSATION, TOOLS)


def test_segments_join_to_the_text_and_separate_assistant_body_from_framing():
    segments = render_segments(CONVERSATION, TOOLS, add_generation_prompt=True)
    assert "".join(s.text for s in segments) == render(CONVERSATION, TOOLS)
    bodies = [s for s in segments if s.kind == "assistant" and s.part == "body"]
    assert [s.message_index for s in bodies] == [2, 6]
    assert bodies[1].text == "Two files."
    framing = [s.text for s in segments if s.message_index == 6 and s.part != "body"]
    assert framing == ["<|im_start|>assistant\n", "<|im_end|>\n"]
    assert segments[-1].kind == "generation_prompt" and segments[-1].message_index is None
    assert {s.kind for s in segments if s.message_index in (3, 4)} == {"tool"}


def test_encode_chat_splices_recorded_tokens_and_extends_the_previous_prompt():
    tok = Tokenizer.default()
    history = CONVERSATION[:5]
    first_prompt = encode_chat(tok, history, TOOLS)
    assert tok.decode(first_prompt) == render(history, TOOLS)
    # The model answered with ids that a re-encoding would not reproduce (odd token split).
    recorded = [*tok.encode("Two"), *tok.encode(" fi"), *tok.encode("les."), tok.im_end_id]
    assert recorded[:-1] != tok.encode("Two files.")
    answered = [*history, {"role": "assistant", "content": "Two files."}, {"role": "user", "content": "ok"}]
    second_prompt = encode_chat(tok, answered, TOOLS, assistant_tokens={5: recorded})
    assert second_prompt[: len(first_prompt) + len(recorded)] == first_prompt + recorded
    assert tok.decode(second_prompt) == render(answered, TOOLS)
    # An output cut off by the length limit (no stop id) gets its <|im_end|> from the template.
    cut = encode_chat(tok, answered, TOOLS, assistant_tokens={5: recorded[:-1]})
    assert cut == second_prompt


def test_parser_extracts_well_formed_tool_calls():
    text = (
        "<think>\nplan it\n</think>\n\nI will look.\n<tool_call>\n"
        '{"name": "Bash", "arguments": {"command": "ls -la"}}\n</tool_call>\n'
        '<tool_call>{"name": "Read", "arguments": "{\\"path\\": \\"x.py\\"}"}</tool_call><|im_end|>'
    )
    parsed = parse_assistant_output(text)
    assert parsed.errors == []
    assert parsed.reasoning == "plan it"
    assert parsed.content == "I will look."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("Bash", {"command": "ls -la"}),
        ("Read", {"path": "x.py"}),
    ]
    assert parse_assistant_output("just text").content == "just text"


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ('<tool_call>\n{"name": "Bash", "arguments": {"command": }\n</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "Bash", "arguments": [1]}</tool_call>', "'arguments' must be an object"),
        ('<tool_call>["Bash"]</tool_call>', "must be an object"),
        ('<tool_call>{"name": "Bash", "arguments": {}', "unterminated"),
        ("stray </tool_call> tag", "without an opening"),
    ],
)
def test_parser_reports_malformed_blocks_and_keeps_their_text(block, message):
    good = '<tool_call>{"name": "Read", "arguments": {"path": "a"}}</tool_call>'
    parsed = parse_assistant_output(f"Before. {good} {block}")
    assert len(parsed.errors) == 1 and message in parsed.errors[0]
    assert block in parsed.content and parsed.content.startswith("Before.")
    assert [c.name for c in parsed.tool_calls] == ["Read"]


def test_render_rejects_unknown_roles_and_non_text_parts():
    with pytest.raises(ValueError, match=r"messages\[0\].role is 'robot'"):
        render([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="'image_url' is not supported"):
        render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


@pytest.mark.parametrize(
    "block",
    ["[" * 3000, '{"name": "f", "arguments": {"x": 1e999}}', '{"name": "f", "arguments": "{\\"x\\": NaN}"}'],
    ids=["nested-past-the-parser", "number-out-of-range", "nan-in-string-arguments"],
)
def test_a_tool_call_json_cannot_hold_stays_text(block: str) -> None:
    """A policy's degenerate output (3,000 brackets) raised RecursionError through the proxy (a 500,
    recorded as a client disconnect); inf or NaN arguments could not be echoed back as JSON. Each is
    malformed markup: kept as text, described in `errors`."""
    text = f"<tool_call>{block}</tool_call>"
    parsed = parse_assistant_output(text)
    assert parsed.tool_calls == [] and parsed.content == text and len(parsed.errors) == 1
