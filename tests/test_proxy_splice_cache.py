"""A replica's splice cache is bounded however many executions it serves (`finish` clears one only on
the replica that served it), and a turn whose entry it dropped is still spliced token-exact, from the
store."""

from __future__ import annotations

import asyncio

import pytest
from sdk_clients import scenario

from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.local import build_local_proxy
from gyre_ray.proxy.splice_cache import SpliceCache

CODEC = ChatCodec.for_model(ModelSection())
ODD_IDS = [t for ch in "Hello" for t in CODEC.encode(ch)]  # not what BPE would make of "Hello"


def test_entries_per_execution_and_tokens_in_all_are_bounded() -> None:
    cache = SpliceCache(per_execution=2, max_tokens=10)
    for key in "abc":
        cache.remember("e1", key, f"call-{key}", [1, 2])
    assert cache.get("e1", "a") is None and cache.get("e1", "c") == ("call-c", [1, 2])
    assert cache.tokens == 4  # a's ids left with it
    cache.remember("e2", "x", "call-x", [0] * 5)
    cache.get("e1", "b")  # e1 used last: e2 is the least recently used
    cache.remember("e3", "y", "call-y", [0] * 4)
    assert cache.get("e2", "x") is None and len(cache) == 2 and cache.tokens == 8
    cache.remember("e3", "y", "call-y2", [0])  # replaced: counted once
    assert cache.tokens == 5 and cache.get("e3", "y") == ("call-y2", [0])
    cache.forget("e1")
    assert cache.tokens == 1 and len(cache) == 1


def test_the_execution_being_remembered_is_kept_even_past_the_token_bound() -> None:
    cache = SpliceCache(per_execution=8, max_tokens=3)
    cache.remember("old", "k", "c0", [1])
    cache.remember("big", "k", "c1", [1, 2, 3, 4, 5])
    assert cache.get("big", "k") == ("c1", [1, 2, 3, 4, 5]) and cache.get("old", "k") is None
    with pytest.raises(ValueError, match="max_tokens"):
        SpliceCache(max_tokens=0)


def test_a_turn_the_replica_forgot_is_spliced_from_the_store(tmp_path) -> None:
    factory = ScriptedEngineFactory(
        {"replies": [(CODEC.encode("ODD_Q"), [*ODD_IDS, CODEC.tokenizer.im_end_id])]}
    )
    proxy = asyncio.run(build_local_proxy(CODEC, factory, tmp_path))
    splices = proxy.service._splices = SpliceCache(max_tokens=1)  # one execution's entries at a time
    other = proxy.register_execution()["execution_id"]
    first_turn = [{"role": "user", "content": "ODD_Q"}]

    async def two_turns(c, execution_id):
        first = await c.openai.chat.completions.create(model="m", messages=first_turn)
        text = first.choices[0].message.content
        assert splices.get(execution_id, "-") is None and len(splices) == 1  # this execution's entry
        splices.remember(other, "k", "call", [1, 2])  # another execution's call pushes it out
        assert len(splices) == 1 and splices.tokens == 2
        history = [*first_turn, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        await c.openai.chat.completions.create(model="m", messages=history)
        return text

    text, (first, second) = scenario(proxy, two_turns)
    assert text == "Hello" and CODEC.encode(text) != ODD_IDS  # only a splice gives back these ids
    assert second.input_ids[: len(first.input_ids) + len(ODD_IDS)] == first.input_ids + ODD_IDS
    assert second.meta["spliced_messages"] == 1
