"""``recship train``: train a model (the built-in DLRM, or --model's) with sharded tables on one or more ranks, with checkpoints.

    recship train --out runs/demo                         # 1 rank, synthetic data, defaults
    recship train --out runs/demo --nproc-per-node 2      # spawns 2 local gloo ranks
    torchrun --nproc-per-node 2 -m recship.trainer --out runs/demo
    recship train --config train.yaml --resume            # YAML or JSON: TrainConfig's fields, as fields or flags

The flags are TrainConfig's fields (recship.trainer.config); torch is imported when the run starts.
"""

import argparse
import json
import sys
from dataclasses import fields
from typing import Any, Dict, List, Optional, Set

from recship.flags import FlagError, json_object, one_of, parse_with_config
from recship.logs import configure_logging
from recship.oserrors import doing, one_line
from recship.trainer.config import TrainConfig, default_of
from recship.trainer.factories import load_factory

_FIELDS = {f.name: f for f in fields(TrainConfig)}


def _default_text(name: str) -> str:
    value = default_of(name)
    if isinstance(value, bool):
        return "on" if value else "off"
    if name == "num_embeddings_per_feature" and len(set(value)) == 1:
        return f"{value[0]} for each of the {len(value)} features"
    if isinstance(value, list):
        return " ".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def help_text(name: str) -> str:
    """Field ``name``'s flag help: its sentence (lower-case, no full stop) and, unless it says it, the default."""
    text = _FIELDS[name].metadata["help"].rstrip(".")
    text = text[0].lower() + text[1:]  # argparse's style, as recship serve's flags
    return text if "default" in text else f"{text} (default {_default_text(name)})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or JSON file of TrainConfig's fields, keys spelled as fields (batch_size) or "
                                         "flags (batch-size); flags given on the command line override it (default: none)")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        value = default_of(f.name)
        kw: Dict[str, Any] = {"default": None, "help": help_text(f.name)}  # None: not given, the file or TrainConfig decides
        names = f.metadata["choices"]
        if names is not None:
            parser.add_argument(flag, type=one_of(names, f.name.replace("_", " ")), choices=names, **kw)
        elif isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif isinstance(value, dict):
            parser.add_argument(flag, type=json_object, metavar="JSON", **kw)
        elif isinstance(value, list):
            parser.add_argument(flag, type=int, nargs="+", metavar="N", **kw)
        else:
            kind = float if isinstance(value, float) else int if isinstance(value, int) else str
            parser.add_argument(flag, type=kind, **kw)


def given_fields(args: argparse.Namespace) -> Set[str]:
    """The TrainConfig fields given by a flag or a ``--config`` key (every flag defaults to None: not given). On
    ``--resume`` these override what the checkpoint records; the others take its values."""
    return {f.name for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed flags (a ``--config`` file's values are their defaults: ``recship.flags``), over
    TrainConfig's defaults."""
    return TrainConfig(**{name: getattr(args, name) for name in given_fields(args)})


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    configure_logging(config.log_format)  # first: importing torch and fbgemm below warns, in this format
    if config.model is not None:  # a wrong --model costs its line before fbgemm_gpu and the trainer load, and before any rank
        load_factory(config.model)
    from recship.trainer.train import launch  # lazy: keeps `recship train --help` torch-free
    with doing("training", config.out):  # an OSError that names no file is the run folder's
        summary = launch(config, given=given_fields(args))
    if summary["rank"] != 0:
        return 0
    done = summary["steps_this_run"]
    if done == 0:
        print(f"nothing to train: the run is already at step {summary['steps']} (--steps {config.steps}); checkpoint {summary['checkpoint']}")
        _print_curves(summary)
        return 0
    final = summary["final_eval"]
    first = sum(summary["losses"][:10]) / max(1, len(summary["losses"][:10]))
    last = sum(summary["losses"][-10:]) / max(1, len(summary["losses"][-10:]))
    print(
        f"trained {done} steps (steps {summary['steps'] - done + 1}-{summary['steps']}) on {summary['world_size']} rank(s) "
        f"of {summary.get('data', config.data)} at batch {summary.get('batch_size', config.batch_size)}: "
        f"loss {first:.4f} -> {last:.4f} (mean of first/last 10 steps), "
        + (f"eval log loss {final['log_loss']:.4f}, AUC {final['auc']:.4f}"
           + "".join(f", {task} log loss {m['log_loss']:.4f}, AUC {m['auc']:.4f}" for task, m in final.get("tasks", {}).items())
           + ", " if final else "")
        + (f"{summary['epochs']} epoch(s), " if summary.get("epochs") else "")
        + f"{summary['samples_per_s']:.0f} samples/s; checkpoint {summary['checkpoint']}"
    )
    _print_curves(summary)
    return 0


def _print_curves(summary: Dict[str, Any]) -> None:
    if summary.get("curves"):
        print(f"curves: {summary['curves']}")


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m recship.trainer`` (what torchrun runs): the same as ``recship train``."""
    parser = argparse.ArgumentParser(prog="recship train", description="Train a DLRM with sharded embedding tables.")
    add_arguments(parser)
    try:
        return run(parse_with_config(parser, sys.argv[1:] if argv is None else argv))
    except (ValueError, OSError, FlagError) as e:  # as recship.cli says them
        print(f"recship train: error: {one_line(e) if isinstance(e, OSError) else e}", file=sys.stderr)
        return 2
