"""TrainConfig: everything a training run needs, filled by the CLI, YAML/JSON files and tests.

This module imports neither torch nor the rest of the trainer, so ``recship train --help`` and
argument errors answer at once; ``recship.trainer.train`` runs the config.
"""

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple, Union

from recship.flags import resolve_device
from recship.names import CPU_OPTIMIZERS, CRITEO_NUM_SPARSE, DEVICE_CHOICES, DLRM_ENTRY, LOG_FORMATS, OPTIMIZERS, SHARDINGS


def option(default: Any = MISSING, help: str = "", *, choices: Optional[Tuple[str, ...]] = None,
           default_factory: Any = MISSING) -> Any:
    """A TrainConfig field with what makes it a flag (recship.trainer.cli): ``help``, its sentence (the default is
    appended to it), and the ``choices`` of a name, taken in either case."""
    metadata = {"help": help, "choices": choices}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    """Everything a training run needs; each field's ``help`` says what it means.

    ``num_embeddings_per_feature`` with one value (or a bare int) gives every one of the DLRM's 26
    features that many rows. ``optimizer``, ``sharding`` and ``device`` take their names in either
    case (``EXACT_SGD`` or ``exact_sgd``) and are stored lower-case.
    """

    out: str = option("runs/recship", "The run folder: checkpoints go to OUT/checkpoints, each rank's summary to "
                      "OUT/summary_rank<r>.json, the loss and eval history to OUT/history.jsonl.")
    steps: int = option(300, "Train until this global step; with --resume, the steps already done count.")
    batch_size: int = option(256, "Examples per rank per step.")
    num_embeddings_per_feature: List[int] = option(
        help=f"Rows of each sparse feature's table, one value per feature; one value gives every one of the DLRM's "
             f"{CRITEO_NUM_SPARSE} features that many rows.", default_factory=lambda: [1000] * CRITEO_NUM_SPARSE)
    embedding_dim: int = option(16, "Width of every embedding table and of the dense arch's output (a multiple of 4).")
    dense_arch: List[int] = option(help="Hidden widths of the DLRM's dense MLP.", default_factory=lambda: [64])
    over_arch: List[int] = option(help="Hidden widths of the DLRM's over MLP (its output is one logit).", default_factory=lambda: [64, 32])
    optimizer: str = option("exact_rowwise_adagrad", "The fused embedding optimizer, in either case; on CPU only "
                            + ", ".join(CPU_OPTIMIZERS) + " run.", choices=OPTIMIZERS)
    embedding_lr: float = option(0.05, "Learning rate of the fused embedding optimizer.")
    dense_lr: float = option(0.05, "Learning rate of the dense layers' Adagrad.")
    sharding: Optional[str] = option(None, "Shard every table this way, in either case (default: the planner picks per table; "
                                           "EmbeddingCollection tables have no table_row_wise: the planner picks theirs then).",
                                     choices=SHARDINGS)
    data: str = option("synthetic", "Training data: synthetic, a Criteo TSV file (repeated epoch after epoch), or a data "
                                    "function package.module:function.")
    eval_data: Optional[str] = option(None, "Evaluation data of the same kinds (default: synthetic data's own held-out stream; "
                                            "none for a file).")
    eval_every: int = option(100, "Evaluate log loss and AUC every this many steps; 0 evaluates at the end only.")
    eval_batches: int = option(8, "Batches per rank in each evaluation.")
    checkpoint_every: int = option(100, "Save a checkpoint every this many steps; 0 saves at the end only.")
    resume: bool = option(False, "Continue from the newest complete checkpoint in OUT/checkpoints, with the model, data and "
                                 "settings its run recorded, except those given as flags.")
    overwrite: bool = option(False, "Delete OUT/checkpoints and start over (a run refuses to train over checkpoints without "
                                    "--resume or this).")
    keep_last: int = option(0, "Keep only the newest N checkpoints; 0 keeps all.")
    seed: int = option(0, "Random seed of the model's initialisation and of synthetic data.")
    model: Optional[str] = option(None, "The model to train, an entry point package.module:factory (default: the built-in "
                                        "DLRM shaped by the flags above).")
    model_args: Dict[str, Any] = option(help="Keyword arguments of --model's factory, a JSON object.", default_factory=dict)
    nproc_per_node: int = option(1, "Local ranks to spawn (gloo on CPU, nccl on CUDA); under torchrun the launcher decides.")
    device: str = option("auto", "Where ranks train: cuda puts rank r on cuda:r of its host, auto picks cuda when torch sees "
                                 "one.", choices=DEVICE_CHOICES)
    progress: bool = option(True, "Show rank 0's progress bar (step, loss, samples/s, epoch) and the final summary.")
    plot: bool = option(True, "Draw OUT/curves.png (train loss, eval log loss and AUC per step, over the whole run across "
                              "resumes) at each evaluation and at the end; it needs matplotlib (pip install 'recship[plots]'), "
                              "without which a run draws none and says so in one line.")
    log_format: str = option("text", "Log lines (warnings, epochs) as text (time, level, logger, message) or json (one object "
                                     "per line, as recship serve writes them).", choices=LOG_FORMATS)

    def use_cuda(self) -> bool:
        return resolve_device(self.device) == "cuda"

    def entry_point(self) -> Tuple[str, Dict[str, Any]]:
        """(entry point, its arguments) of the model to train: ``model``, else the built-in DLRM
        (``recship.models.dlrm:builtin``) shaped by the DLRM flags."""
        if self.model is not None:
            return self.model, dict(self.model_args)
        return DLRM_ENTRY, {"num_embeddings_per_feature": list(self.num_embeddings_per_feature), "embedding_dim": self.embedding_dim,
                            "dense_arch": list(self.dense_arch), "over_arch": list(self.over_arch)}

    def __post_init__(self) -> None:
        self.num_embeddings_per_feature = table_sizes(self.num_embeddings_per_feature)
        if self.steps < 0 or self.batch_size < 1:
            raise ValueError(f"--steps must be >= 0 and --batch-size >= 1, got {self.steps} and {self.batch_size}")
        if self.model is not None and any(d is not None and d != "synthetic" and not _is_entry_point(d) for d in (self.data, self.eval_data)):
            raise ValueError("--model trains on synthetic data sized from the model's tables or on a data function "
                             "(--data package.module:function); Criteo TSV files feed the built-in DLRM only")
        if self.model is not None:  # the DLRM's shape flags do not shape another model: refused, not ignored
            given = [f for f in DLRM_SHAPE if getattr(self, f) != (table_sizes(default_of(f)) if f == "num_embeddings_per_feature"
                                                                     else default_of(f))]
            if given:
                flags = ", ".join("--" + f.replace("_", "-") for f in given)
                raise ValueError(f"{flags} shape{'s' if len(given) == 1 else ''} the built-in DLRM, not --model's: its factory and "
                                 "--model-args shape it")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: continue the checkpoints or delete them")
        if self.keep_last < 0:
            raise ValueError(f"--keep-last must be >= 0 (0 keeps every checkpoint), got {self.keep_last}")
        for f in fields(self):  # names given in either case, stored lower-case
            if f.metadata["choices"] is not None and getattr(self, f.name) is not None:
                setattr(self, f.name, name_in(getattr(self, f.name), f.metadata["choices"], f.name.replace("_", " ")))
        if self.device == "cuda":
            import torch  # lazy: keeps `recship train --help` torch-free

            if not torch.cuda.is_available():
                raise ValueError("--device cuda asked for, but torch sees no CUDA device")


DLRM_SHAPE = ("num_embeddings_per_feature", "embedding_dim", "dense_arch", "over_arch")  # the built-in DLRM's factory arguments

# What a checkpoint records of its run and ``--resume`` takes back unless given (recship.trainer.train.resumed_config):
# the model (entry point and arguments, or the DLRM's shape), its data, and how it was trained. Not among them: the run
# folder, --steps, --resume/--overwrite, the number of ranks and the device (a resume may change both), and display.
RECORDED = ("model", "model_args", *DLRM_SHAPE, "data", "eval_data", "batch_size", "optimizer", "embedding_lr", "dense_lr",
            "sharding", "seed", "eval_every", "eval_batches", "checkpoint_every", "keep_last")


def changed_fields(config: "TrainConfig") -> "set[str]":
    """The fields of ``config`` whose value differs from TrainConfig's default: what a Python caller of
    ``launch(config)`` counts as given when it names no ``given`` set (a value equal to the default cannot be told
    from one left out; pass ``given`` to override a recorded value with a default one)."""
    out = set()
    for f in fields(config):
        default = default_of(f.name)
        if f.name == "num_embeddings_per_feature":
            default = table_sizes(default)
        if getattr(config, f.name) != default:
            out.add(f.name)
    return out


def default_of(name: str) -> Any:
    """TrainConfig's default for field ``name``, without building a TrainConfig."""
    f = next(f for f in fields(TrainConfig) if f.name == name)
    return f.default_factory() if f.default_factory is not MISSING else f.default


def name_in(value: Any, names: "tuple[str, ...]", what: str) -> str:
    """``value`` lower-cased if it is one of ``names`` (given in either case), else a ValueError listing them."""
    if not isinstance(value, str) or value.lower() not in names:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(names)} (either case)")
    return value.lower()


def table_sizes(value: Union[int, List[int]]) -> List[int]:
    """Rows per sparse feature: one value (an int or a one-element list) is every DLRM feature's size."""
    sizes = [value] if isinstance(value, int) else list(value)
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise ValueError(f"--num-embeddings-per-feature takes positive integers, got {value!r}")
    return sizes * CRITEO_NUM_SPARSE if len(sizes) == 1 else sizes


def _is_entry_point(data: str) -> bool:
    from recship.trainer.data import is_entry_point  # lazy: keeps `recship train --help` torch-free (only --model asks)

    return is_entry_point(data)
