"""``recship export``: a training checkpoint -> a quantized, self-checked artifact (model.pt and/or model.pt2, tables.bin,
manifest.json, sample/) or a repository version.

The flags are ExportConfig's fields (recship.export.config): ``--dtype``/``dtype``,
``--table-dtype``/``table_dtypes``, ``--model-name``/``model_name`` (``--name`` for short),
``--model-version``/``model_version``. Torch is imported when the export starts,
so ``--help`` and argument errors answer at once.
"""

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from tqdm.contrib.logging import logging_redirect_tqdm

from recship.flags import json_object, one_of
from recship.logs import configure_logging
from recship.names import DEVICE_CHOICES, EXPORT_DTYPES, EXPORT_FORMATS, INFERENCE_SHARDINGS, LOG_FORMATS, MODEL_NAME

if TYPE_CHECKING:
    from recship.export.config import ExportConfig

DTYPES = EXPORT_DTYPES
SHARDINGS = INFERENCE_SHARDINGS
FORMATS = EXPORT_FORMATS


def _pair(what: str) -> Callable[[str], str]:
    def parse(item: str) -> str:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise argparse.ArgumentTypeError(f"{what} expects NAME=VALUE, got {item!r}")
        return item

    return parse


def _pairs(items: Optional[List[str]]) -> Dict[str, str]:
    out = {}
    for item in items or []:  # each checked by _pair
        name, _, value = item.partition("=")
        out[name] = value
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="the training checkpoint directory to export, e.g. runs/x/checkpoints/step_N (required)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="the artifact directory to create; it must not exist unless --overwrite (required, or --model-repo)")
    where.add_argument("--model-repo", dest="repo", metavar="DIR",
                       help="a model repository (as recship serve --model-repo DIR): write DIR/NAME/<next version>/ "
                            "atomically; needs --model-name NAME (required, or --out)")
    parser.add_argument("--dtype", default="int8", type=one_of(DTYPES, "data type"), choices=DTYPES,
                        help="every table's type, in either case; auto picks per table the smallest type within "
                             "--error-budget (default int8)")
    parser.add_argument("--table-dtype", action="append", type=_pair("--table-dtype"), metavar="TABLE=DTYPE",
                        help="one table's type, overriding --dtype; repeatable (default: none, every table takes --dtype)")
    parser.add_argument("--error-budget", type=float,
                        help="the largest allowed error: per table for auto types, of the outputs in validation "
                             "(default: 0.01 for auto types, no limit in validation)")
    parser.add_argument("--device", default="cpu", type=one_of(DEVICE_CHOICES, "device"), choices=DEVICE_CHOICES,
                        help="the device the artifact will run on, which decides row alignment; auto: cuda where torch "
                             "sees a GPU, else cpu (default cpu)")
    parser.add_argument("--shards", type=int, default=1, help="devices to spread the tables over (default 1)")
    parser.add_argument("--sharding", type=one_of(SHARDINGS, "sharding"), choices=SHARDINGS,
                        help="shard every table this way, in either case (default: the planner picks per table)")
    parser.add_argument("--validation-batch-size", type=int, default=512, help="the batch size of the validation batches (default 512)")
    parser.add_argument("--id-policy", action="append", type=_pair("--id-policy"), metavar="FEATURE=reject|modulo",
                        help="what a feature does with an id past its table's rows, repeatable; *=modulo sets every feature "
                             "(default reject: the request is refused)")
    parser.add_argument("--model-name", dest="model_name", metavar="NAME",
                        help="the model's name in the manifest; with --model-repo, also its folder (default model; needed with "
                             "--model-repo)")
    parser.add_argument("--model-version", dest="model_version", type=int, metavar="N",
                        help="the model version in the manifest (default 1; with --model-repo, the next free number)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out directory (default off)")
    parser.add_argument("--model", metavar="PACKAGE.MODULE:FACTORY",
                        help="the model to rebuild the checkpoint into (default: the entry point the checkpoint records; "
                             "checkpoints of the built-in DLRM need none)")
    parser.add_argument("--model-args", type=json_object, default={}, metavar="JSON",
                        help="keyword arguments of --model's factory, a JSON object (default {})")
    parser.add_argument("--format", default="auto", type=one_of(FORMATS, "format"), choices=FORMATS,
                        help="model files: aoti is the torch.export + AOTInductor model.pt2 (which loaders prefer), plus the "
                             "TorchScript model.pt where TorchScript compiles the model (a one-line note where not); both demands "
                             "both; torchscript demands model.pt alone; auto is aoti where a C++ compiler is present, else "
                             "torchscript (default auto)")
    parser.add_argument("--target-isa", default="x86-64-v3",
                        help="the -march of model.pt2's compiled kernels; native for this machine's CPU only (default x86-64-v3: AVX2)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--compile-cache", metavar="DIR", default=None,
                       help="keep model.pt2's compiled programs here, by graph: a re-export of the same architecture "
                            "skips the compile (default $RECSHIP_CACHE_DIR, else ~/.cache/recship/aoti)")
    cache.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                       help="compile model.pt2 afresh and keep nothing (default: the compile cache is used)")
    parser.add_argument("--row-block", type=int, default=None, metavar="N",
                        help="examples per forward: every batch runs in blocks of exactly N rows, so a request's answer does "
                             "not depend on the requests it was batched with (bitwise); 0 runs whole batches (faster at large "
                             "batches, answers may differ in the last bits) (default 64)")
    parser.add_argument("--num-dense", type=int, help="the model's dense width, if it has no num_dense attribute (default: the attribute)")
    parser.add_argument("--eval-data", metavar="FILE|PACKAGE.MODULE:FUNCTION",
                        help="validate on this data: a Criteo TSV file (13 dense, 26 sparse features), or a "
                             "function(batch_size, rank, world_size) returning (dense, KeyedJaggedTensor, labels or None) "
                             "batches (default: synthetic batches drawn like the training run's)")
    parser.add_argument("--plot", action=argparse.BooleanOptionalAction, default=None,
                        help="put tables.png in the artifact: each table's bytes and quantization error as a chart; --plot "
                             "makes a missing matplotlib (pip install 'recship[plots]') an error, --no-plot skips the chart "
                             "(default: drawn when matplotlib is installed)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="print the stage bar (on a terminal only) and the summary: tables, validation, the "
                             "artifact's path; --no-progress prints only warnings and errors (default --progress)")
    parser.add_argument("--log-format", default="text", type=one_of(LOG_FORMATS, "log format"), choices=LOG_FORMATS,
                        help="log lines as text (time, level, logger, message) or json (one object per line, as recship "
                             "serve writes them) (default text)")


def export_model(source: str, config: "ExportConfig") -> Dict[str, Any]:
    """recship.export.pipeline.export_model (the stages), imported (with torch) on the first call."""
    from recship.export.pipeline import export_model as export  # lazy: `recship export --help` stays torch-free

    return export(source, config)


def run(args: argparse.Namespace) -> int:
    if args.repo is not None:
        if args.model_name is None:
            raise ValueError("--model-repo needs --model-name NAME: the model's folder in the repository")
        if not MODEL_NAME.fullmatch(args.model_name):
            raise ValueError(f"--model-name {args.model_name!r} cannot name a model folder: 1-128 of A-Z a-z 0-9 _ . - "
                             "starting with a letter or digit")
        if args.model_version is not None:
            raise ValueError("--model-version does not apply with --model-repo: the version is the next number in the repository")
        if args.overwrite:
            raise ValueError("--overwrite does not apply with --model-repo: every export is a new version")
    if not Path(args.checkpoint).exists():  # before torch loads: a mistyped path answers at once
        raise FileNotFoundError(f"checkpoint not found: {args.checkpoint}")
    configure_logging(args.log_format)  # first: importing torch and fbgemm below warns, in this format
    from recship.export.config import ExportConfig  # lazy: torch, from here on (`recship export --help` stays torch-free)

    config = ExportConfig(
        out=args.out,
        repo=args.repo,
        dtype=args.dtype,
        table_dtypes=_pairs(args.table_dtype),
        error_budget=args.error_budget,
        device=args.device,
        shards=args.shards,
        sharding=args.sharding,
        validation_batch_size=args.validation_batch_size,
        id_policy=_pairs(args.id_policy),
        model_name=args.model_name if args.model_name is not None else "model",
        model_version=args.model_version if args.model_version is not None else 1,
        overwrite=args.overwrite,
        model=args.model,
        model_args=args.model_args,
        num_dense=args.num_dense,
        eval_data=args.eval_data,
        format=args.format,
        target_isa=args.target_isa,
        **({"row_block": args.row_block} if args.row_block is not None else {}),
        plot=args.plot,
        compile_cache=True if args.compile_cache is None else args.compile_cache,
        progress=args.progress is not False,
    )
    with logging_redirect_tqdm():  # log lines go above the stage bar, not into it
        export_model(args.checkpoint, config)
    return 0

