"""The ``recship`` command: one subcommand per stage of the pipeline.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``;
expected errors (ValueError, FileNotFoundError, a flag's unknown name) become one line on
stderr and exit code 2. A subcommand's module is imported only when it runs, and its
``add_arguments`` imports no torch, so ``--version``, ``--help`` and argument errors answer at once.
"""

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from recship import __version__

# name -> (module, one-line help). Modules are imported only when their command runs.
_COMMANDS = {
    "demo": ("recship.demo", "run the end-to-end walk-through on built-in data"),
    "train": ("recship.trainer.cli", "train a DLRM with sharded embedding tables"),
    "export": ("recship.export.cli", "export a checkpoint to a quantized TorchScript artifact"),
    "inspect": ("recship.export.inspect", "print an artifact's manifest and self-check it"),
    "serve": ("recship.serving.server", "serve exported models over gRPC"),
    "predict": ("recship.serving.client", "send one request to a running server"),
}


class FlagError(Exception):
    """A flag was given a name it does not take; ``main`` prints it as one line and returns 2.

    Not a ValueError on purpose: argparse turns those into a generic "invalid value" and SystemExit,
    while this one names the valid values the way the Python API's ValueError does.
    """


def one_of(names: Sequence[str], what: str) -> Callable[[str], str]:
    """An argparse ``type`` for a flag with ``choices=names``: any case of a name gives the
    lower-case name (``EXACT_SGD`` -> ``exact_sgd``), anything else is a FlagError listing them."""

    def parse(value: str) -> str:
        if value.lower() in names:
            return value.lower()
        raise FlagError(f"unknown {what} {value!r}; expected one of {', '.join(names)} (either case)")

    parse.__name__ = what.replace(" ", "_")
    return parse


def json_object(text: str) -> Dict[str, Any]:
    """An argparse ``type``: a JSON object (``--model-args '{"rows": 10}'``); anything else is an argument error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {type(value).__name__}")
    return value


def parse_mapping(text: str, *, yaml_format: bool = True, holds: str = "settings") -> Dict[str, Any]:
    """``text`` (YAML, or JSON) as a mapping; an empty document is {}. ValueError saying what is wrong."""
    try:
        if yaml_format:
            import yaml

            values = yaml.safe_load(text)
        else:
            values = json.loads(text)
    except Exception as e:
        raise ValueError(f"not valid {'YAML' if yaml_format else 'JSON'}: {e}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"expected a mapping of {holds} to values, got {type(values).__name__}")
    return values


def read_config_file(path: str) -> Dict[str, Any]:
    """A ``--config`` file's mapping: YAML (.yaml, .yml) or JSON; ValueError/FileNotFoundError naming the file."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--config: no such file: {file}")
    try:
        return parse_mapping(file.read_text(), yaml_format=file.suffix in (".yaml", ".yml"), holds="flags")
    except ValueError as e:
        raise ValueError(f"--config {file}: {e}") from None


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


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> Dict[str, Any]:
    """Makes a YAML/JSON file's values ``parser``'s defaults, so flags on the command line still win.

    Keys are the parser's flags, spelled either way (``max-batch-size`` or ``max_batch_size``); a key
    that is no flag, or a value outside a flag's choices or of the wrong type, is a ValueError naming it.
    """
    file = Path(path)
    values = read_config_file(path)
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    flags = sorted(a.option_strings[0].lstrip("-") for a in actions.values())
    defaults: Dict[str, Any] = {}
    for key, value in values.items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None:
            raise ValueError(f"--config {file}: unknown key {key!r}; the keys are these flags: {', '.join(flags)}")
        flag = action.option_strings[0]
        convert = action.type if callable(action.type) else str
        kind = "an integer" if convert is int else "a number" if convert is float else "a string" if convert is str else "a value"
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ValueError(f"--config {file}: {key}: {flag} takes true or false, got {value!r}")
        elif isinstance(value, bool) or (convert is int and isinstance(value, float)):
            # what YAML reads as true or 1.5 is no integer, number or name: int() would make it 1, str() "True"
            raise ValueError(f"--config {file}: {key}: {flag} takes {kind}, got {value!r}")
        elif value is not None and callable(action.type):
            try:
                value = convert(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError, FlagError) as e:
                if isinstance(e, FlagError):
                    raise ValueError(f"--config {file}: {key}: {flag}: {e}") from None
                raise ValueError(f"--config {file}: {key}: {flag} takes {kind}, got {value!r}") from None
        elif isinstance(action, argparse._AppendAction):  # a repeatable flag: a list, or one value
            value = [str(v) for v in (value if isinstance(value, list) else [value])]
        elif isinstance(value, (dict, list)):
            raise ValueError(f"--config {file}: {key}: {flag} takes one value, got {value!r}")
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"--config {file}: {key}: {flag} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
        defaults[action.dest] = value
        action.required = False  # given by the file
    parser.set_defaults(**defaults)
    return defaults


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # --version, --help and a mistyped command need no subcommand module: answer them without torch
    command = argv[0] if argv and argv[0] in _COMMANDS else ""
    parser = build_parser(command)
    if command and getattr(importlib.import_module(_COMMANDS[command][0]), "CONFIG_FILE", False):
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        known, _ = pre.parse_known_args(argv[1:])
        if known.config:
            try:
                apply_config_file(subcommand_parser(parser, command), known.config)
            except (ValueError, FileNotFoundError) as e:
                print(f"recship {command}: error: {e}", file=sys.stderr)
                return 2
    try:
        args = parser.parse_args(argv)
    except FlagError as e:
        print(f"recship {command}: error: {e}", file=sys.stderr)
        return 2
    module = importlib.import_module(args._module)
    try:
        return module.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"recship {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
