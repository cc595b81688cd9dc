"""The warm-up: synthetic toy-harness transcripts rendered as the proxy renders them, the supervised pass
(its cached shared prefix gives the same loss as full sequences; a few steps lower the reply loss), and
the cache that lets a second run reuse an identical warm-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gyre_ray.config import load_config
from gyre_ray.envs.words import WORD_POOL, word_tasks
from gyre_ray.model import load_policy
from gyre_ray.model.chat_template import parse_assistant_output
from gyre_ray.model.kv_cache import KVCache
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.trainers.master import MasterWeights
from gyre_ray.warmup.sft import (
    DONE_FILE,
    _buckets,
    _common_prefix,
    _suffix_batch,
    prepare_policy,
    supervised_pass,
)
from gyre_ray.warmup.transcripts import toy_transcripts


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec.for_model(load_config(None, []).model)


@pytest.fixture(scope="module")
def transcripts(codec: ChatCodec) -> list:
    return toy_transcripts(
        word_tasks(), codec, executions=4, words=list(WORD_POOL), words_per_reply=3, turns=2, seed=0
    )


def test_transcripts_cover_every_call_of_the_toy_harness(transcripts: list, codec: ChatCodec) -> None:
    # 2 main turns, a retried call (2 calls), 2 sub-agents, a summary, 1 turn after the compaction
    assert len(transcripts) == 4 * 8
    tool_calls = texts = 0
    for t in transcripts:
        assert t.reply_ids[-1] == codec.tokenizer.im_end_id
        assert codec.decode(t.prompt_ids).endswith("<|im_start|>assistant\n")
        parsed = parse_assistant_output(codec.decode(t.reply_ids))
        assert not parsed.errors
        if parsed.tool_calls:
            (call,) = parsed.tool_calls
            assert call.name == "write_file"
            words = call.arguments["text"].split()
            tool_calls += 1
        else:
            words = parsed.content.split()
            texts += 1
        assert len(words) == 3 and set(words) <= set(WORD_POOL)
    assert tool_calls == 4 * 5 and texts == 4 * 3  # tools are offered to main calls only


def test_cached_prefix_gives_the_loss_of_full_sequences(transcripts: list) -> None:
    model, _, _ = load_policy(load_config(None, []).model)
    items = max(_buckets(transcripts), key=len)[:4]
    start = _common_prefix(items)
    assert start > 100  # the system prompt and the tool list
    cache = KVCache()
    with torch.no_grad():
        model.hidden_states(torch.tensor([items[0].prompt_ids[:start]]), None, None, cache)
    ids, mask = _suffix_batch(items, start, 0)
    cached = model.hidden_states(ids, None, None, cache.select_rows([0] * len(items)))[mask]
    ids0, mask0 = _suffix_batch(items, 0, 0)
    full = model.hidden_states(ids0, None, None, None)[mask0]
    assert int(mask.sum()) == sum(len(t.reply_ids) for t in items)
    assert torch.allclose(cached, full, atol=1e-4)


def test_supervised_pass_lowers_the_reply_loss(transcripts: list) -> None:
    model, _, _ = load_policy(load_config(None, []).model)
    losses = supervised_pass(model, transcripts, steps=12, lr=3e-3, batch_size=4, seed=0)
    assert losses[0] > 8.0  # about log(8192) for a random policy
    assert sum(losses[-3:]) / 3 < losses[0] - 3.0, losses


def test_a_bfloat16_warm_up_steps_float32_master_weights(transcripts: list, monkeypatch) -> None:
    """As the trainers (tests/test_trainer_torch.py): AdamW on bfloat16 weights in place rounds small
    updates away. The warm-up of a bfloat16 model steps float32 copies and rounds them back."""
    model, _, _ = load_policy(load_config(None, ["model.dtype=bfloat16"]).model)
    start = {k: v.detach().float().clone() for k, v in model.named_parameters()}
    steps: list[int] = []
    real = MasterWeights.step

    def counted(self, optimizer):
        steps.append(1)
        return real(self, optimizer)

    monkeypatch.setattr(MasterWeights, "step", counted)
    supervised_pass(model, transcripts, steps=2, lr=3e-3, batch_size=2, seed=0)
    assert len(steps) == 2 and all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert any(not torch.equal(p.float(), start[k]) for k, p in model.named_parameters())


def test_prepare_policy_trains_once_then_reuses(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = load_config(None, ["agents.task_set=words", "warmup.steps=2", "warmup.executions=1"])
    first = prepare_policy(cfg, tmp_path)
    folder = Path(first.model.path)
    assert folder.parent == tmp_path and (folder / "model.safetensors").is_file()
    info = json.loads((folder / DONE_FILE).read_text())
    assert info["steps"] == 2 and info["transcripts"] == 8
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    again = prepare_policy(cfg, tmp_path)
    assert again.model.path == first.model.path
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert "reused" in capsys.readouterr().out
    (folder / DONE_FILE).write_text("{}")  # damaged (a full disk, a hand edit): trained again
    assert prepare_policy(cfg, tmp_path).model.path == first.model.path
    assert "damaged (KeyError): training it again" in capsys.readouterr().out
    assert json.loads((folder / DONE_FILE).read_text())["steps"] == 2
    other = prepare_policy(
        cfg.model_copy(update={"model": cfg.model.model_copy(update={"seed": 1})}), tmp_path
    )
    assert other.model.path != first.model.path  # a different start is a different warm-up
    model, _, _ = load_policy(first.model)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_warmup_off_or_on_a_foreign_harness() -> None:
    cfg = load_config(None, [])
    assert prepare_policy(cfg, Path("/nonexistent")) is cfg
    # refused with the config (`gyre-ray config` too), not after Ray and the cells started
    with pytest.raises(
        ValueError,
        match="warmup.steps=1 trains on the toy harness's transcripts, but agents.harness=claude-code",
    ):
        load_config(None, ["warmup.steps=1", "agents.harness=claude-code"])
