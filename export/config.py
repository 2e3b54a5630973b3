"""ExportConfig: what an export writes and how (``recship export``'s flags), checked when it is made."""

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import torch

from recship.export.blocks import DEFAULT_ROW_BLOCK
from recship.flags import resolve_device
from recship.names import DEVICE_CHOICES, EXPORT_FORMATS, ID_POLICIES, INFERENCE_SHARDINGS, MODEL_NAME
from recship.plots import require
from recship.quantize.quantizer import QuantConfig


class ExportError(ValueError):
    """The export cannot proceed; the message names the problem."""


TABLES_CHART = "tables.png"  # the artifact's optional chart of its tables (ExportConfig.plot)


@dataclass
class ExportConfig:
    """Args:
    out: the artifact directory to create (must not exist unless overwrite).
    repo: instead of ``out``, a model repository (``recship serve --model-repo``): the artifact
        becomes ``repo/<model_name>/<next version>/`` (1 + the largest number there, 1 if none),
        written beside it under a hidden name and renamed into place; its manifest's version is
        that number (``model_version`` is not used). Racing exports take different numbers.
    dtype: default table type (int8, int4, int2, fp8, fp16, fp32, auto).
    table_dtypes: table -> type overrides.
    error_budget: for auto types, the largest per-table error; for validation, the
        largest allowed output error (|prob| for a DLRM, relative for embeddings).
    device: "cpu", "cuda" or "auto" (cuda where torch sees a GPU, else cpu; resolved here);
        shards: number of devices (on CPU: shards in host memory).
    sharding: force table_wise / row_wise / column_wise for every table (default: planner).
    validation_batch_size: batch size of the validation batches.
    id_policy: feature -> "reject" (default) or "modulo".
    format: "aoti": the torch.export + AOTInductor model.pt2 (loaders prefer it where it runs),
        and the TorchScript model.pt beside it where TorchScript compiles the model (the fallback
        where model.pt2 cannot run; without it, a one-line note); "both": both, each required;
        "torchscript": model.pt alone, required; "auto": aoti where a C++ compiler is present,
        else torchscript with a one-line note. A failed stage is named (fx trace, TorchScript,
        torch.export, AOTInductor compile).
    target_isa: -march of model.pt2's kernels (default x86-64-v3, AVX2; "native": this CPU only).
    row_block: examples per forward: every loader runs a batch in blocks of exactly this many rows (the last padded),
        so a request's answer is bitwise the same whatever it was batched with (export/blocks.py); 0: whole batches.
    plot: whether the artifact also gets ``tables.png``, each table's bytes and quantization
        error as a chart (recship/plots.py; a picture beside the contract's files, read by no
        loader): False (default) none; True one, matplotlib missing being an error up front;
        None one if matplotlib is installed, else a warning (``recship export`` without --plot).
    compile_cache: where model.pt2's compiled programs are kept by graph, so an export of an architecture compiled
        before skips the compile (recship/export/compile_cache.py): True (default) ``$RECSHIP_CACHE_DIR``, else
        ``~/.cache/recship/aoti``; a folder's path; False none (every export compiles).
    """

    out: Optional[str] = None
    dtype: str = "int8"
    table_dtypes: Dict[str, str] = field(default_factory=dict)
    error_budget: Optional[float] = None
    device: str = "cpu"
    shards: int = 1
    sharding: Optional[str] = None
    validation_batch_size: int = 512
    model_name: str = "model"
    model_version: int = 1
    id_policy: Dict[str, str] = field(default_factory=dict)
    error_minimizing: bool = True
    validation_batches: int = 4
    sample_batch_size: int = 4
    seed: int = 0
    overwrite: bool = False
    progress: bool = True
    num_dense: Optional[int] = None  # any-model export: the dense width (else the model's num_dense attribute)
    eval_data: Optional[str] = None  # validate on this data: a Criteo TSV file, or package.module:function (see docs)
    model: Optional[str] = None  # entry point package.module:factory to rebuild a checkpoint's model (default: what it records)
    model_args: Dict[str, Any] = field(default_factory=dict)
    format: str = "auto"  # torchscript | aoti | both | auto (aoti where a C++ compiler is present)
    target_isa: str = "x86-64-v3"  # -march of model.pt2's kernels ("native": this machine's CPU only)
    row_block: int = DEFAULT_ROW_BLOCK  # examples per forward (export/blocks.py); 0: whole batches
    repo: Optional[str] = None  # instead of out: write repo/<model_name>/<next version>/ (see above)
    plot: Optional[bool] = False  # tables.png in the artifact: False no, True yes (or an error), None if matplotlib is there
    compile_cache: Union[bool, str, os.PathLike] = True  # model.pt2's compile cache: True the default folder, a folder, False none (see above)

    def __post_init__(self) -> None:
        if (self.out is None) == (self.repo is None):
            raise ExportError("give either out (an artifact folder) or repo (a model repository), "
                              + ("not both" if self.out is not None else "one of them"))
        if self.repo is not None:
            if not MODEL_NAME.fullmatch(self.model_name):
                raise ExportError(f"model name {self.model_name!r} cannot name a model folder of a repository: "
                                  "1-128 of A-Z a-z 0-9 _ . - starting with a letter or digit")
            if self.overwrite:
                raise ExportError("overwrite does not apply to repo (--overwrite with --repo): every export is a new version")
        if self.format not in EXPORT_FORMATS:
            raise ExportError(f"format must be auto, torchscript, aoti or both, got {self.format!r}")
        if self.device not in DEVICE_CHOICES:
            raise ExportError(f"device must be cpu, cuda or auto, got {self.device!r}")
        self.device = resolve_device(self.device)
        if self.device == "cuda" and torch.cuda.device_count() < self.shards:
            raise ExportError(f"{self.shards} cuda shard(s) asked for, {torch.cuda.device_count()} CUDA device(s) present")
        if isinstance(self.row_block, bool) or not isinstance(self.row_block, int) or self.row_block < 0:
            raise ExportError(f"row_block must be an integer >= 0 (0: whole batches), got {self.row_block!r}")
        if self.shards < 1:
            raise ExportError(f"shards must be >= 1, got {self.shards}")
        if self.sharding is not None and self.sharding not in INFERENCE_SHARDINGS:
            raise ExportError(f"sharding must be table_wise, row_wise or column_wise, got {self.sharding!r}")
        for f, p in self.id_policy.items():
            if p not in ID_POLICIES:
                raise ExportError(f"feature {f!r}: id policy must be one of {ID_POLICIES}, got {p!r}")
        try:
            QuantConfig(dtype=self.dtype, table_dtypes=dict(self.table_dtypes), error_budget=self.error_budget or 0.01)
        except ValueError as e:
            raise ExportError(str(e)) from None
        if self.error_budget is not None and self.error_budget <= 0:
            raise ExportError(f"error_budget must be > 0, got {self.error_budget}")
        if not isinstance(self.compile_cache, (bool, str, os.PathLike)) or self.compile_cache == "":
            raise ExportError(f"compile_cache must be True, False or a folder's path, got {self.compile_cache!r}")
        if self.plot is True:  # asked for: refuse now, not after the export's work
            require()


def expand_id_policy(id_policy: Dict[str, str], features: List[str]) -> Dict[str, str]:
    """``{"*": p}`` gives every feature policy ``p``; named features override it."""
    if "*" not in id_policy:
        return dict(id_policy)
    return {**{f: id_policy["*"] for f in features}, **{f: p for f, p in id_policy.items() if f != "*"}}
