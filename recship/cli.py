"""The ``recship`` command: one subcommand per stage of the pipeline.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``;
expected errors (ValueError, a flag's unknown name) and every OSError (a missing file, a full disk, a
read-only folder: ``recship.oserrors.one_line``) become one line on stderr and exit code 2. A subcommand's
module is imported only when it runs, and its ``add_arguments`` imports no torch, so ``--version``,
``--help`` and argument errors answer at once.
"""

import argparse
import importlib
import sys
from typing import List, Optional

from recship import __version__
from recship.flags import FlagError, apply_config_argument
from recship.logs import error_line
from recship.oserrors import one_line

# name -> (module, one-line help). Modules are imported only when their command runs.
_COMMANDS = {
    "demo": ("recship.demo", "run the end-to-end walk-through on built-in data"),
    "train": ("recship.trainer.cli", "train any model that follows the model contract (--model; the built-in DLRM by default) with sharded embedding tables"),
    "export": ("recship.export.cli", "export a checkpoint to a quantized, self-checking artifact (model.pt2 and/or TorchScript model.pt)"),
    "inspect": ("recship.export.inspect", "print an artifact's manifest and self-check it"),
    "serve": ("recship.serving.cli", "serve exported models over gRPC (recship Predictor, KServe v2) and HTTP (KServe v2 REST)"),
    "predict": ("recship.serving.client", "send one request to a running server"),
    "example-request": ("recship.serving.example_request", "print a valid request for an exported model (KServe v2 REST or recship predict JSON), from its sample"),
}


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The CLI's parser; a subcommand's module (and torch with it) is imported only for the
    subcommand named by ``command`` (None: all of them, e.g. to list every flag)."""
    parser = argparse.ArgumentParser(
        prog="recship",
        description="Train, quantize, export and serve recommendation models with large embedding tables.",
    )
    parser.add_argument("--version", action="version", version=f"recship {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        if command is None or command == name:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` inside ``build_parser()``'s parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # --version, --help and a mistyped command need no subcommand module: answer them without torch
    command = argv[0] if argv and argv[0] in _COMMANDS else ""
    parser = build_parser(command)
    if command:  # a --config file of the subcommand's flags: its values become their defaults
        try:
            apply_config_argument(subcommand_parser(parser, command), argv[1:])
        except (ValueError, OSError) as e:
            print(f"recship {command}: error: {one_line(e) if isinstance(e, OSError) else e}", file=sys.stderr)
            return 2
    try:
        args = parser.parse_args(argv)
    except FlagError as e:
        print(f"recship {command}: error: {e}", file=sys.stderr)
        return 2
    module = importlib.import_module(args._module)
    try:
        return module.run(args)
    except (ValueError, OSError) as e:  # an OSError (a full disk, a read-only folder): its file, cause and stage
        message = one_line(e) if isinstance(e, OSError) else e
        print(error_line(args.command, message, getattr(args, "log_format", None) or "text"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
