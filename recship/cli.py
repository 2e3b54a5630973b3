"""The ``recship`` command: one subcommand per stage of the pipeline.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``;
expected errors (ValueError, FileNotFoundError) become one line on stderr and
exit code 2.
"""

import argparse
import importlib
import sys
from typing import List, Optional

from recship import __version__

# name -> (module, one-line help). Modules are imported only when their command runs.
_COMMANDS = {
    "demo": ("recship.demo", "run the end-to-end walk-through on built-in data"),
    "train": ("recship.trainer.train", "train a DLRM with sharded embedding tables"),
    "export": ("recship.export.cli", "export a checkpoint to a quantized TorchScript artifact"),
    "inspect": ("recship.export.inspect", "print an artifact's manifest and self-check it"),
    "serve": ("recship.serving.server", "serve exported models over gRPC"),
    "predict": ("recship.serving.client", "send one request to a running server"),
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


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # --version, --help and a mistyped command need no subcommand module: answer them without torch
    command = argv[0] if argv and argv[0] in _COMMANDS else ""
    args = build_parser(command).parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return module.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"recship {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
