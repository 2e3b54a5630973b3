"""Reading what users type: flag values (any-case names, JSON objects) and YAML/JSON settings files,
applied to an argparse parser as its defaults. A leaf: it imports nothing of recship (nor torch), so
every layer's command line and config check can use it without importing the ``recship`` command.
"""

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Dict, Sequence

import yaml


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


def resolve_device(device: str) -> str:
    """``device`` as one of DEVICES: "auto" is "cuda" where torch sees a GPU, else "cpu"; cpu and cuda stay."""
    if device != "auto":
        return device
    import torch  # lazy: --help and flag errors stay torch-free

    return "cuda" if torch.cuda.is_available() else "cpu"


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
        if action.dest in defaults:
            raise ValueError(f"--config {file}: {key}: {flag} given twice (spelled with - and _)")
        convert = action.type if callable(action.type) else str
        kind = "an integer" if convert is int else "a number" if convert is float else "a string" if convert is str else "a value"
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ValueError(f"--config {file}: {key}: {flag} takes true or false, got {value!r}")
        elif isinstance(value, bool) or (convert is int and isinstance(value, float)):
            # what YAML reads as true or 1.5 is no integer, number or name: int() would make it 1, str() "True"
            raise ValueError(f"--config {file}: {key}: {flag} takes {kind}, got {value!r}")
        elif action.nargs == "+":  # a list flag: a list, or one value
            items = value if isinstance(value, list) else [value]
            if any(isinstance(v, bool) or (convert is int and not isinstance(v, int)) for v in items):
                raise ValueError(f"--config {file}: {key}: {flag} takes {kind} or a list of them, got {value!r}")
            value = [convert(v) for v in items]
        elif isinstance(value, dict) and action.type is json_object:  # a JSON-object flag: the mapping itself
            pass
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
        if action.choices is not None and value is not None and value not in action.choices:
            raise ValueError(f"--config {file}: {key}: {flag} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
        defaults[action.dest] = value
        action.required = False  # given by the file
    parser.set_defaults(**defaults)
    return defaults


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with a ``--config FILE`` among them applied first (its values as defaults, so
    flags on the command line win), for a parser that has a --config option."""
    apply_config_argument(parser, argv)
    return parser.parse_args(argv)


def apply_config_argument(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Applies the ``--config FILE`` in ``argv`` to ``parser`` (see ``apply_config_file``); nothing without one, or
    when ``parser`` takes no --config."""
    if not any("--config" in a.option_strings for a in parser._actions):
        return
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(list(argv))
    if known.config:
        apply_config_file(parser, known.config)
