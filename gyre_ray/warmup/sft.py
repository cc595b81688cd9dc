"""The warm-up's supervised pass and its cache: `prepare_policy(cfg, root)` runs before RL starts.

With `warmup.steps` > 0 the job first trains the configured policy (a random preset by default) on the
toy harness's synthetic transcripts (`gyre_ray.warmup.transcripts`): next-token cross-entropy on the
reply tokens only, AdamW, in the driver process. The result is an HF model folder under the runs root,
named by a hash of everything that shaped it (model and warm-up sections, task prompts, harness turns),
so a second run with the same settings reuses it; `model.path` then points RL's cells at it. The
warm-up has its own learning rate, so a control run with `trainer.lr=0` starts from the same weights.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gyre_ray.trainers.master import MasterWeights

if TYPE_CHECKING:
    from gyre_ray.config import GyreConfig
    from gyre_ray.warmup.transcripts import Transcript

FORMAT_VERSION = 1  # bump when the transcripts or the loss change, so old caches are not reused
DONE_FILE = "warmup.json"


def warmup_key(cfg: GyreConfig, prompts: list[str]) -> str:
    """A short hash of everything the warm-up's result depends on."""
    payload = {
        "format": FORMAT_VERSION,
        "model": cfg.model.model_dump(mode="json"),
        "warmup": cfg.warmup.model_dump(mode="json"),
        "prompts": prompts,
        "turns": cfg.agents.toy_turns,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def _common_prefix(items: list[Transcript]) -> int:
    """Length of the prefix every item's prompt shares, short of each prompt's last token (whose hidden
    state predicts the first reply token and so must carry gradients)."""
    limit = min(len(t.prompt_ids) for t in items) - 1
    first = items[0].prompt_ids
    n = 0
    while n < limit and all(t.prompt_ids[n] == first[n] for t in items):
        n += 1
    return n


def _suffix_batch(items: list[Transcript], start: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids from position `start` on (B, T) and the target mask (B, T): True where the
    column predicts a reply token (the next column holds it)."""
    seqs = [(t.prompt_ids + t.reply_ids)[start:] for t in items]
    ids = torch.full((len(items), max(map(len, seqs))), pad_id, dtype=torch.long)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for row, (t, seq) in enumerate(zip(items, seqs, strict=True)):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, len(t.prompt_ids) - 1 - start : len(seq) - 1] = True
    return ids, mask


def _buckets(transcripts: list[Transcript], key_tokens: int = 24) -> list[list[Transcript]]:
    """Transcripts grouped by their first `key_tokens` prompt ids (calls that share a system prompt)."""
    groups: dict[tuple[int, ...], list[Transcript]] = {}
    for t in transcripts:
        groups.setdefault(tuple(t.prompt_ids[:key_tokens]), []).append(t)
    return list(groups.values())


def supervised_pass(
    model: torch.nn.Module,
    transcripts: list[Transcript],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train `model` in place on the reply tokens of `transcripts`; returns the loss of every step.

    Each step draws its calls from one bucket of calls sharing a system prompt (bucket chosen in
    proportion to its size) and runs their common prefix once, without gradients, into a KV cache the
    rows then extend: the prompt's shared part conditions the replies but is not itself trained, which
    cuts the warm-up's compute about threefold (the system prompt and tool list are most of a call).
    """
    from gyre_ray.model.kv_cache import KVCache

    rng = random.Random(seed)
    buckets = _buckets(transcripts)
    params = dict(model.named_parameters())
    master = MasterWeights(params) if MasterWeights.needed(params) else None  # a bfloat16 model
    optimizer = torch.optim.AdamW(master.tensors() if master else params.values(), lr=lr, weight_decay=0.0)
    # linear decay to a tenth: the last steps settle the weights the rollouts will sample from
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 - 0.9 * i / max(1, steps - 1))
    pad_id = model.args.pad_token_id or 0
    losses = []
    model.train()
    for _ in range(steps):
        bucket = rng.choices(buckets, weights=[len(b) for b in buckets])[0]
        items = rng.sample(bucket, min(batch_size, len(bucket)))
        start = _common_prefix(items)
        cache = KVCache()
        if start:
            with torch.no_grad():
                model.hidden_states(torch.tensor([items[0].prompt_ids[:start]]), None, None, cache)
            cache = cache.select_rows([0] * len(items))
        ids, mask = _suffix_batch(items, start, pad_id)
        hidden = model.hidden_states(ids, None, None, cache if start else None)[mask]
        targets = ids[:, 1:][mask[:, :-1]]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden).float(), targets)
        for param in params.values():
            param.grad = None
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if master is not None:  # float32 copies stepped, rounded back (`gyre_ray.trainers.master`)
            master.step(optimizer)
        else:
            optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(len(losses), losses[-1])
    model.eval()
    return losses


def _run_warmup(cfg: GyreConfig, tasks: list[Any], folder: Path) -> dict[str, Any]:
    from gyre_ray.model import load_policy
    from gyre_ray.model.checkpoint import save_hf
    from gyre_ray.proxy.codec import ChatCodec
    from gyre_ray.warmup.transcripts import toy_transcripts

    w = cfg.warmup
    started = time.perf_counter()
    codec = ChatCodec.for_model(cfg.model)
    transcripts = toy_transcripts(
        tasks,
        codec,
        executions=w.executions,
        words=w.words,
        words_per_reply=w.words_per_reply,
        turns=cfg.agents.toy_turns,
        seed=cfg.model.seed,
    )

    def progress(step: int, loss: float) -> None:
        if step % 25 == 0 or step == w.steps:
            print(f"gyre-ray: warm-up step {step}/{w.steps}: reply loss {loss:.3f}", flush=True)

    torch.manual_seed(cfg.model.seed)
    threads = torch.get_num_threads()
    if w.torch_threads:
        torch.set_num_threads(w.torch_threads)
    try:
        model, _, args = load_policy(cfg.model)
        losses = supervised_pass(
            model,
            transcripts,
            steps=w.steps,
            lr=w.lr,
            batch_size=w.batch_size,
            seed=cfg.model.seed,
            progress=progress,
        )
    finally:
        torch.set_num_threads(threads)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, args, tmp)
    tail = losses[-10:]
    info = {
        "steps": w.steps,
        "transcripts": len(transcripts),
        "loss_first": losses[0],
        "loss_last10_mean": sum(tail) / len(tail),
        "seconds": round(time.perf_counter() - started, 2),
    }
    (tmp / DONE_FILE).write_text(json.dumps(info, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return info


def _cached(folder: Path) -> dict[str, Any] | None:
    """The cached warm-up's `DONE_FILE`, or None when there is none; a damaged one is said and trained
    again (the folder is replaced whole)."""
    path = folder / DONE_FILE
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        float(info["loss_last10_mean"])
        return info
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"gyre-ray: the cached warm-up {path} is damaged ({type(exc).__name__}): training it again")
        return None


def prepare_policy(cfg: GyreConfig, root: Path) -> GyreConfig:
    """`cfg` itself when the warm-up is off; else `cfg` with `model.path` at the warmed-up policy
    (trained now, or reused from `root/warmup-<hash>` when an identical warm-up already ran)."""
    if cfg.warmup.steps == 0:
        return cfg
    from gyre_ray.envs.base import get_task_set

    tasks = get_task_set(cfg.agents.task_set)
    folder = root / f"warmup-{warmup_key(cfg, [t.prompt for t in tasks])}"
    info = _cached(folder)
    if info is not None:
        print(f"gyre-ray: warm-up reused from {folder} (loss {info['loss_last10_mean']:.3f})", flush=True)
    else:
        print(
            f"gyre-ray: warm-up: {cfg.warmup.steps} supervised steps on toy-harness transcripts", flush=True
        )
        info = _run_warmup(cfg, tasks, folder)
        print(
            f"gyre-ray: warm-up done in {info['seconds']:.1f} s: reply loss {info['loss_first']:.3f} -> "
            f"{info['loss_last10_mean']:.3f} nats/token ({info['transcripts']} transcript calls); {folder}",
            flush=True,
        )
    model = cfg.model.model_copy(update={"path": str(folder)})
    return cfg.model_copy(update={"model": model})
