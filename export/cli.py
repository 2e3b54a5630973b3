"""``recship export`` and ``recship inspect``."""

import argparse
import json
from typing import Any, Dict, List

from recship.export.pipeline import MODEL_NAME, ExportConfig, ExportError, export_model


def _pairs(items: List[str], what: str) -> Dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ExportError(f"{what} expects NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def _json_object(text: str, what: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ExportError(f"{what} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ExportError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a training checkpoint directory (runs/x/checkpoints/step_N)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="artifact directory to create")
    where.add_argument("--repo", metavar="DIR",
                       help="a model repository (recship serve --model-repo DIR): write DIR/NAME/<next version>/ "
                            "atomically (needs --name NAME)")
    parser.add_argument("--dtype", default="int8", help="int8 | int4 | int2 | fp8 | fp16 | fp32 | auto (default int8)")
    parser.add_argument("--table-dtype", action="append", metavar="TABLE=DTYPE", help="per-table type, repeatable")
    parser.add_argument("--error-budget", type=float, help="auto types and validation: the largest allowed error")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the device the artifact will run on (decides row alignment)")
    parser.add_argument("--shards", type=int, default=1, help="devices to spread the tables over (default 1)")
    parser.add_argument("--sharding", choices=["table_wise", "row_wise", "column_wise"], help="force one sharding type")
    parser.add_argument("--batch-size-hint", type=int, default=512, help="validation batch size (default 512)")
    parser.add_argument("--id-policy", action="append", metavar="FEATURE=reject|modulo",
                        help="per-feature id policy, repeatable; *=modulo sets every feature")
    parser.add_argument("--name", help="model name in the manifest (default model); with --repo, also the model's folder")
    parser.add_argument("--version", type=int, help="model version in the manifest (default 1; --repo chooses it)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing artifact")
    parser.add_argument("--model", metavar="PACKAGE.MODULE:FACTORY",
                        help="the model to rebuild the checkpoint into (default: the entry point the checkpoint records; "
                             "checkpoints of the built-in DLRM need none)")
    parser.add_argument("--model-args", default="{}", metavar="JSON", help="keyword arguments of --model's factory (a JSON object)")
    parser.add_argument("--format", default="auto", choices=["auto", "torchscript", "aoti", "both"],
                        help="model files: torchscript (model.pt), both/aoti (model.pt and the AOTInductor model.pt2, "
                             "which loaders prefer); auto: both where a C++ compiler is present, else torchscript (default auto)")
    parser.add_argument("--target-isa", default="x86-64-v3",
                        help="-march of model.pt2's compiled kernels; 'native' for this machine's CPU only (default x86-64-v3: AVX2)")
    parser.add_argument("--num-dense", type=int, help="the model's dense width, if it has no num_dense attribute")
    parser.add_argument("--eval-data", metavar="FILE|PACKAGE.MODULE:FUNCTION",
                        help="validate on this data instead of synthetic batches: a Criteo TSV file (13 dense, 26 sparse "
                             "features), or a function(batch_size, rank, world_size) returning (dense, KeyedJaggedTensor, labels or None) batches")


def run(args: argparse.Namespace) -> int:
    if args.repo is not None:
        if args.name is None:
            raise ExportError("--repo needs --name NAME: the model's folder in the repository")
        if not MODEL_NAME.fullmatch(args.name):
            raise ExportError(f"--name {args.name!r} cannot name a model folder: 1-128 of A-Z a-z 0-9 _ . - "
                              "starting with a letter or digit")
        if args.version is not None:
            raise ExportError("--version does not apply with --repo: the version is the next number in the repository")
        if args.overwrite:
            raise ExportError("--overwrite does not apply with --repo: every export is a new version")
    config = ExportConfig(
        out=args.out,
        repo=args.repo,
        dtype=args.dtype,
        table_dtypes=_pairs(args.table_dtype, "--table-dtype"),
        error_budget=args.error_budget,
        device=args.device,
        shards=args.shards,
        sharding=args.sharding,
        batch_size_hint=args.batch_size_hint,
        id_policy=_pairs(args.id_policy, "--id-policy"),
        model_name=args.name if args.name is not None else "model",
        model_version=args.version if args.version is not None else 1,
        overwrite=args.overwrite,
        model=args.model,
        model_args=_json_object(args.model_args, "--model-args"),
        num_dense=args.num_dense,
        eval_data=args.eval_data,
        format=args.format,
        target_isa=args.target_isa,
    )
    export_model(args.checkpoint, config)
    return 0
