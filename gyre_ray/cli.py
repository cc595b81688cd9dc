"""The `gyre-ray` command line: one sub-command per job, each registered by the module that owns it.

Sub-command modules keep heavy imports (torch, ray) inside their handlers so that
`gyre-ray --help` and pure-Python commands such as `simulate` start fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

# Each module exposes `register(subparsers) -> None` and sets `handler` defaults on its parsers.
COMMAND_MODULES = (
    "gyre_ray.train",
    "gyre_ray.eval_cli",
    "gyre_ray.engines.cli",
    "gyre_ray.trajectory.cli",
    "gyre_ray.sim.cli",
    "gyre_ray.proxy.cli",
    "gyre_ray.trainers.cli",
    "gyre_ray.observability.report",
    "gyre_ray.runs_cli",
)


def _config_command(args: argparse.Namespace) -> int:
    from gyre_ray.config import describe, load_config

    cfg = load_config(args.config, args.overrides)
    if args.describe:
        for key, default, text in describe():
            print(f"{key:42s} {default:24s} {text}")
    else:
        print(cfg.model_dump_json(indent=2))
    return 0


# options a second occurrence of is refused (argparse keeps the last: `--resume A --resume B` resumed B)
ONCE_OPTIONS = ("--config", "--resume", "--attach", "--run", "--model-dir", "--out")


class _StoreOnce(argparse._StoreAction):
    """A `store` option given twice is an error, not a silent last-one-wins (`--config a --config b`
    would run b alone: a second config file does not add to the first)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        from gyre_ray.config import ConfigError

        earlier = getattr(namespace, self.dest, self.default)
        if earlier is not self.default:
            raise ConfigError(
                f"{self.option_strings[-1]} given twice ({earlier}, then {values}): give it once (a second "
                "one would replace the first, not add to it)"
            )
        super().__call__(parser, namespace, values, option_string)


def _refuse_repeats(parser: argparse.ArgumentParser) -> None:
    """Make each of ONCE_OPTIONS refuse a second occurrence, on `parser` and every sub-command's parser
    (the sub-command modules declare them as plain `store` options)."""
    for action in parser._actions:
        if type(action) is argparse._StoreAction and set(action.option_strings) & set(ONCE_OPTIONS):
            action.__class__ = _StoreOnce
        elif isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                _refuse_repeats(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gyre-ray", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    cfg = sub.add_parser("config", help="validate a config and print it (or describe every field)")
    cfg.add_argument("--config", default=None, help="YAML config file")
    cfg.add_argument(
        "--describe",
        action="store_true",
        help="list every field with its default and meaning (the defaults, whatever --config and overrides say; "
        "without --describe: the config they make)",
    )
    cfg.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5")
    cfg.set_defaults(handler=_config_command)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    _refuse_repeats(parser)
    return parser


def _subcommand_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The innermost (sub-)command parser the words of `argv` name (`traj show ...` -> `traj show`'s)."""
    for word in argv:
        actions = parser._subparsers._group_actions if parser._subparsers else ()
        chosen = next(
            (
                a.choices[word]
                for a in actions
                if isinstance(a, argparse._SubParsersAction) and word in a.choices
            ),
            None,
        )
        if chosen is not None:
            parser = chosen
    return parser


def main(argv: list[str] | None = None) -> int:
    from gyre_ray.config import ConfigError

    parser = build_parser()
    words = sys.argv[1:] if argv is None else argv
    try:
        args, unknown = parser.parse_known_args(argv)
    except ConfigError as exc:  # an option given twice (`_StoreOnce`)
        print(f"{_subcommand_parser(parser, words).prog}: {exc}", file=sys.stderr)
        return 2
    handler = getattr(args, "handler", None)
    if unknown:  # said by the sub-command's parser, with its own usage line (exits 2)
        _subcommand_parser(parser, words).error(f"unrecognized arguments: {' '.join(unknown)}")
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args) or 0)
    except ConfigError as exc:
        print(f"gyre-ray {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gyre-ray: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gyre-ray traj show DIR | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141


if __name__ == "__main__":
    sys.exit(main())
