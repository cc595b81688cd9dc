"""`gyre-ray logprobs`: per-token log-probabilities of one sequence under a trainer backend.

Scores the sequence as the trainer does (`Trainer.compute_logprobs` on one plain row), so it is how a
user checks that a backend (torch, or Megatron-core with tensor parallel N and context parallel M)
reads an HF folder the same way. Token 0 has no predecessor: its log-prob is reported as null (JSON) or "-" (table). Bad
input prints one line naming what is wrong and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "logprobs",
        help="per-token log-probs of a sequence under a trainer backend (torch or megatron)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--model-dir", required=True, help="HF model folder (config.json + safetensors)")
    parser.add_argument(
        "--trainer-backend", choices=("torch", "megatron"), default="torch", help="default torch"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (megatron only; default 1)")
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks per tensor-parallel rank (megatron only; default 1)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="text to score (the folder's tokenizer, else the default one)")
    source.add_argument("--tokens", help="token ids to score, comma-separated, e.g. 1,2,3")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    parser.set_defaults(handler=_logprobs_command)


def _fail(message: str) -> int:
    print(f"gyre-ray logprobs: {message}", file=sys.stderr)
    return 2


def _parse_tokens(text: str) -> list[int]:
    parts = text.split(",")
    if any(not part.strip() for part in parts):
        raise ValueError(f"--tokens must be comma-separated integers, got {text!r} (an empty item)")
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"--tokens must be comma-separated integers, got {text!r}") from None


def _logprobs_command(args: argparse.Namespace) -> int:
    if args.tp < 1 or (args.tp > 1 and args.trainer_backend != "megatron"):
        return _fail(f"--tp {args.tp}: tensor parallelism needs --trainer-backend megatron and tp >= 1")
    if args.cp < 1 or (args.cp > 1 and args.trainer_backend != "megatron"):
        return _fail(f"--cp {args.cp}: context parallelism needs --trainer-backend megatron and cp >= 1")
    try:
        token_ids = None if args.tokens is None else _parse_tokens(args.tokens)
    except ValueError as exc:
        return _fail(str(exc))
    from gyre_ray.cli_inputs import run_folder_hint
    from gyre_ray.model.checkpoint import load_hf

    hint = run_folder_hint(Path(args.model_dir), offer_run=False)  # logprobs takes no --run
    if hint:
        return _fail(f"--model-dir {hint}")
    try:
        model, model_args = load_hf(args.model_dir, dtype="float32")
    except (OSError, ValueError) as exc:
        return _fail(f"cannot load the model from {args.model_dir}: {exc}")
    tokenizer = _tokenizer(args.model_dir, model_args.vocab_size)
    if token_ids is None:
        if tokenizer is None:
            return _fail(f"--text needs a tokenizer.json in {args.model_dir} (or use --tokens)")
        token_ids = tokenizer.encode(args.text)
    if len(token_ids) < 2:  # the first token is the context: nothing predicts it
        return _fail(
            f"nothing to score: {len(token_ids)} token(s); the first is only context, so give at least 2"
        )
    bad = [t for t in token_ids if not 0 <= t < model_args.vocab_size]
    if bad:
        return _fail(f"token ids {bad[:5]} are outside the vocabulary [0, {model_args.vocab_size})")
    try:
        logprobs = _score(args.trainer_backend, (args.tp, args.cp), model, model_args, token_ids)
    except ModuleNotFoundError as exc:
        return _fail(
            f"{exc.name} is not installed (the megatron backend needs megatron-core: `make install`)"
        )
    except ValueError as exc:
        return _fail(str(exc))
    values: list[float | None] = [None, *logprobs[1:]]
    if args.json:
        payload = {
            "backend": args.trainer_backend,
            "tensor_parallel_size": args.tp,
            "context_parallel_size": args.cp,
            "token_ids": token_ids,
            "logprobs": values,
            "sum": sum(logprobs[1:]),
        }
        print(json.dumps(payload))
        return 0
    for index, (token, value) in enumerate(zip(token_ids, values, strict=True)):
        shown = "-" if value is None else f"{value:.6f}"
        text = "" if tokenizer is None else repr(tokenizer.decode([token]))
        print(f"{index:6d} {token:8d} {shown:>12s}  {text}")
    print(
        f"sum {sum(logprobs[1:]):.6f} over {len(token_ids) - 1} predicted token(s) ({args.trainer_backend})"
    )
    return 0


def _tokenizer(folder: str, vocab_size: int) -> Any:
    """The folder's tokenizer, else the default one if its ids fit the model, else None."""
    from pathlib import Path

    from gyre_ray.model.tokenizer import TOKENIZER_FILE, Tokenizer

    if (Path(folder) / TOKENIZER_FILE).is_file():
        return Tokenizer.from_folder(folder)
    default = Tokenizer.default()
    return default if default.vocab_size <= vocab_size else None


def _score(
    backend: str, parallel: tuple[int, int], model: Any, model_args: Any, token_ids: list[int]
) -> list[float]:
    """Log-probs of `token_ids` (index 0: 0.0, undefined) from the backend's `compute_logprobs`, with
    `parallel` = (tensor, context) parallel sizes."""
    import torch

    from gyre_ray.algo import get_loss
    from gyre_ray.trainers.batch import MicroBatch, sequential_parent_index
    from gyre_ray.trainers.config import TrainerSection
    from gyre_ray.trainers.factory import make_trainer

    tp, cp = parallel
    section = TrainerSection(backend=backend, tensor_parallel_size=tp, context_parallel_size=cp)
    trainer = make_trainer(section, model, model_args, get_loss("gspo"))
    n = len(token_ids)
    batch = MicroBatch(
        input_ids=torch.tensor([token_ids]),
        position_ids=torch.arange(n).unsqueeze(0),
        parent_index=sequential_parent_index(1, n),
    )
    try:
        return [float(v) for v in trainer.compute_logprobs(batch)[0]]
    finally:
        close = getattr(trainer, "close", None)
        if close is not None:
            close()
