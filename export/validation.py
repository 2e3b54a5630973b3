"""What validation runs on and compares: batches of the user's data (``eval_batches``), the float and quantized
references of a pooled lookup (``pooled_lookup``, ``quantized_pooled_lookup``), and the refusal of non-finite
outputs (``refuse_non_finite``)."""

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from recship.export.config import ExportError
from recship.sparse import JaggedTensor, KeyedJaggedTensor
from recship.sparse.ids import check_id_dtype
from recship.modules.embedding_configs import EmbeddingBagConfig
from recship.modules.types import DataType
from recship.quantize.rowwise import dequantize_rows, quantize_rows
from recship.trainer.data import CriteoTSV, task_labels
from recship.trainer.entry_point import load_factory

# a validation request: dense [B, num_dense] float32, its KJT, labels [B] (or [B, T] for T tasks) float32 or None
Batch = Tuple[torch.Tensor, KeyedJaggedTensor, Optional[torch.Tensor]]


def eval_batches(
    eval_data: str, names: List[str], rows: List[int], num_dense: int, weighted: bool, n: int, batch: int
) -> List[Batch]:
    """Up to ``n`` batches [(dense, kjt, labels or None)] of the user's data.

    ``eval_data`` is a Criteo TSV file (label, 13 integers, 26 hex ids a line: for models
    with those 13 dense and 26 sparse features, in order), or ``package.module:function``
    where ``function(batch_size=B, rank=0, world_size=1)`` returns an iterable of (dense
    [B, num_dense] float, KeyedJaggedTensor of the model's features, labels [B] or [B, T] float, or None):
    the data functions ``recship train --data`` takes.
    """
    if Path(eval_data).is_file():
        if len(names) != CriteoTSV.NUM_SPARSE or num_dense != CriteoTSV.NUM_DENSE:
            raise ExportError(f"--eval-data {eval_data}: a Criteo TSV file feeds models with 13 dense and 26 sparse features; "
                              f"this one has {num_dense} and {len(names)} (give a package.module:function instead)")
        source = ((b.dense, b.sparse, b.labels) for b in CriteoTSV(eval_data, rows, batch, feature_names=names))
    elif ":" in eval_data:
        data_function: Callable[..., Any] = load_factory(eval_data)  # typed for model factories; this one yields batches
        try:
            source = iter(data_function(batch_size=batch, rank=0, world_size=1))
        except ValueError as e:
            raise ExportError(str(e).replace("--model", "--eval-data")) from None
        except Exception as e:
            raise ExportError(f"--eval-data {eval_data} raised {type(e).__name__}: {e}") from None
    else:
        raise ExportError(f"--eval-data {eval_data}: no such file (or give package.module:function)")
    out: List[Batch] = []
    for item in source:
        if len(out) == n:
            break
        dense, kjt, labels = item
        if list(kjt.keys()) != names:
            raise ExportError(f"--eval-data {eval_data}: batches must have the features {names}, in order; got {kjt.keys()}")
        if (kjt.weights_or_none() is not None) != weighted:
            raise ExportError(f"--eval-data {eval_data}: the model's features are {'weighted' if weighted else 'unweighted'}; "
                              "the batches' are not")
        if labels is not None:
            try:
                labels = task_labels(labels, dense.shape[0], f"--eval-data {eval_data}")
            except ValueError as e:
                raise ExportError(str(e)) from None
        out.append((dense.float(), kjt, labels))
    if not out:
        raise ExportError(f"--eval-data {eval_data} gave no batches")
    return out


def pooled_lookup(weight: torch.Tensor, jt: JaggedTensor, t: EmbeddingBagConfig, weighted: bool) -> torch.Tensor:
    """The float reference of one feature's pooled lookup: ``weight`` [rows, dim] of table ``t``,
    ``jt`` the feature's JaggedTensor (B bags) -> [B, dim] float32, pooled as ``t`` says
    (``weighted``: scaled by the JaggedTensor's per-id weights first)."""
    check_id_dtype(jt.values(), "feature lookup")
    ids = jt.values().to(torch.int64)
    mode = "mean" if t.pooling.value == "MEAN" and not weighted else "sum"
    out = nn.functional.embedding_bag(
        ids, weight.float(), jt.offsets().to(torch.int64), mode=mode, include_last_offset=True,
        per_sample_weights=jt.weights_or_none() if weighted else None,
    )
    if weighted and t.pooling.value == "MEAN":
        out = out / jt.lengths().clamp(min=1).unsqueeze(1).to(out.dtype)
    return out


def quantized_pooled_lookup(weight: torch.Tensor, jt: JaggedTensor, t: EmbeddingBagConfig, weighted: bool, data_type: DataType,
                            error_minimizing: bool, blocks: List[Tuple[int, int]]) -> torch.Tensor:
    """What table ``t`` stored as ``data_type`` answers for ``jt``: the float rows it looks up, each column
    block (col_offset, cols) quantized and dequantized as its shard stores it, then pooled as
    ``pooled_lookup`` does. The exported model must agree with it up to float rounding, whatever its
    sharding and kernels."""
    check_id_dtype(jt.values(), "feature lookup")
    ids = jt.values().to(torch.int64)
    unique, inverse = torch.unique(ids, return_inverse=True)
    rows = weight[unique].float()
    stored = torch.cat([dequantize_rows(quantize_rows(rows[:, c : c + w], data_type, error_minimizing), data_type, w)
                        for c, w in blocks], dim=1)
    local = type(jt)(values=inverse, weights=jt.weights_or_none(), lengths=jt.lengths(), offsets=jt.offsets())
    return pooled_lookup(stored, local, t, weighted)


def refuse_non_finite(outputs: Dict[str, torch.Tensor], which: str, model: Optional[nn.Module]) -> None:
    """ExportError if an output of ``which`` model on a validation batch holds NaN or inf (naming ``model``'s
    non-finite parameters, if any): nothing non-finite is exported."""
    for name, value in outputs.items():
        if not bool(torch.isfinite(value).all()):
            params = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())] if model is not None else []
            cause = (f"the dense parameters {params[:5]} hold NaN or inf (did the training run diverge?)" if params
                     else "check the validation data and the model's forward")
            raise ExportError(f"validation failed: output {name!r} of {which} holds NaN or inf on the validation batches; {cause}")
