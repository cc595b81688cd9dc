"""`gyre-ray generate`: try the policy from the shell through the torch rollout engine.

The prompt becomes one ChatML user turn (the model package's chat template); the reply is printed
as text, or with `--json` as {"text", "token_ids", "logprobs", "finish_reason"}. Bad input prints
one line naming the limit and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate a reply to one prompt with the policy (torch engine)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--prompt", required=True, help="user message text")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of the text")
    parser.add_argument("--run", default=None, help="a run folder: its newest checkpoint's policy")
    parser.add_argument("--model-dir", default=None, help="an HF model folder (the same as model.path=DIR)")
    parser.add_argument("--config", default=None, help="YAML config file (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.seed=3")
    parser.set_defaults(handler=_generate_command)


def _fail(message: str) -> int:
    print(f"gyre-ray generate: {message}", file=sys.stderr)
    return 2


def _policy_path(args: argparse.Namespace) -> str | None:
    """`model.path` for --run (its newest good checkpoint's trainer folder, as `eval --run` takes it: a
    damaged newer one is skipped with a warning on stderr) or --model-dir; None for neither. Set on
    the config as it is, not as a `key=value` override (whose value YAML reads: a folder named `null`
    was no folder, one with " #" in its name was cut there)."""
    from gyre_ray.checkpoint import CheckpointError, newest_good, trainer_dir
    from gyre_ray.cli_inputs import refuse_model_path_clash, warn_on_stderr
    from gyre_ray.config import ConfigError

    if args.run and args.model_dir:
        raise ConfigError("give --run or --model-dir, not both")
    given = f"--run {args.run}" if args.run else f"--model-dir {args.model_dir}"
    if args.run or args.model_dir:
        refuse_model_path_clash(given, args.overrides, args.config)
    if args.run:
        try:
            return str(trainer_dir(newest_good(args.run, warn=warn_on_stderr)[0]))
        except CheckpointError as exc:
            raise ConfigError(f"--run {args.run}: {exc}") from None
    return args.model_dir or None


def _generate_command(args: argparse.Namespace) -> int:
    from gyre_ray.cli_inputs import run_folder_hint
    from gyre_ray.config import load_config

    config = load_config(args.config, list(args.overrides))
    path = _policy_path(args)
    if path is not None:
        config = config.model_copy(update={"model": config.model.model_copy(update={"path": path})})
    if config.model.path and (hint := run_folder_hint(Path(config.model.path))):
        return _fail(f"{'--model-dir' if args.model_dir else 'model.path'} {hint}")
    if not args.prompt.strip():
        return _fail("--prompt is empty: give the text of a user message")

    import asyncio

    from gyre_ray.engines.base import EngineInputError, GenerateRequest, SamplingParams
    from gyre_ray.engines.factory import make_engine
    from gyre_ray.model import load_policy
    from gyre_ray.model.chat_template import encode_chat

    try:
        model, tokenizer, model_args = load_policy(config.model)
    except (OSError, ValueError) as exc:
        return _fail(f"cannot load the policy ({config.model.path or config.model.preset}): {exc}")
    prompt_ids = encode_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    try:
        engine = make_engine(config.engine, model, model_args, stop_token_ids=tokenizer.stop_ids())
    except NotImplementedError as exc:
        return _fail(str(exc))
    try:
        result = asyncio.run(engine.generate(GenerateRequest("cli", prompt_ids, sampling)))
    except EngineInputError as exc:
        return _fail(str(exc))
    finally:
        engine.shutdown()
    if not config.model.path:  # said once it worked, so that a failure stays one line
        print(
            f"gyre-ray generate: the {config.model.preset} preset's randomly initialised weights (expect "
            "gibberish); --run RUN_DIR or --model-dir DIR takes a trained policy",
            file=sys.stderr,
        )
    text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
    if args.json:
        payload = {
            "text": text,
            "token_ids": result.output_ids,
            "logprobs": result.output_logprobs,
            "finish_reason": result.finish_reason,
        }
        print(json.dumps(payload))
    else:
        print(text)
    return 0
