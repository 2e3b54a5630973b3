"""Strict validation of prediction requests against a model's manifest.

Every check raises InvalidRequest with a message naming the field; nothing invalid
reaches a model or a batch shared with other requests.
"""

from dataclasses import dataclass
from typing import Dict, List

import numpy as np
import torch

from recship.sparse import KeyedJaggedTensor


class InvalidRequest(ValueError):
    """The request is malformed; the message names the offending field (gRPC INVALID_ARGUMENT)."""


@dataclass
class ModelSpec:
    """What validation needs from a manifest."""

    features: List[str]
    rows: Dict[str, int]
    modulo: Dict[str, bool]
    weighted: bool
    num_dense: int
    max_batch_size: int

    @staticmethod
    def from_manifest(manifest: dict, max_batch_size: int) -> "ModelSpec":
        feats = manifest["sparse_features"]
        return ModelSpec(
            features=[f["name"] for f in feats],
            rows={f["name"]: int(f["rows"]) for f in feats},
            modulo={f["name"]: f["id_policy"] == "modulo" for f in feats},
            weighted=bool(manifest["weighted"]),
            num_dense=int(manifest["num_dense"]),
            max_batch_size=max_batch_size,
        )


@dataclass
class ParsedRequest:
    """A validated request: dense [B, n_dense] and the KJT in the model's feature order."""

    batch_size: int
    dense: torch.Tensor
    sparse: KeyedJaggedTensor


def parse_request(request, spec: ModelSpec) -> ParsedRequest:
    """PredictRequest -> ParsedRequest, or InvalidRequest naming what is wrong."""
    b = int(request.batch_size)
    if b <= 0:
        raise InvalidRequest(f"batch_size must be > 0, got {b}")
    if b > spec.max_batch_size:
        raise InvalidRequest(f"batch_size {b} exceeds the model's limit of {spec.max_batch_size}")
    given: Dict[str, object] = {}
    for feature in request.sparse:
        if feature.name in given:
            raise InvalidRequest(f"sparse feature {feature.name!r} appears twice")
        if feature.name not in spec.rows:
            raise InvalidRequest(f"unknown sparse feature {feature.name!r}; the model takes {spec.features}")
        given[feature.name] = feature
    missing = [f for f in spec.features if f not in given]
    if missing:
        raise InvalidRequest(f"missing sparse features {missing}")
    lengths, values, weights = [], [], []
    for name in spec.features:
        feature = given[name]
        lens = np.asarray(feature.lengths, dtype=np.int32)
        ids = np.asarray(feature.ids, dtype=np.int64)
        if lens.shape[0] != b:
            raise InvalidRequest(f"sparse feature {name!r}: {lens.shape[0]} lengths for batch_size {b}")
        if lens.size and int(lens.min()) < 0:
            raise InvalidRequest(f"sparse feature {name!r}: negative length {int(lens.min())}")
        if int(lens.sum(dtype=np.int64)) != ids.shape[0]:
            raise InvalidRequest(f"sparse feature {name!r}: sum(lengths) = {int(lens.sum())} but {ids.shape[0]} ids")
        rows = spec.rows[name]
        if ids.size:
            if spec.modulo[name]:
                ids = np.mod(ids, rows)
            else:
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= rows:
                    bad = lo if lo < 0 else hi
                    raise InvalidRequest(f"sparse feature {name!r}: id {bad} is out of range [0, {rows})")
        w = np.asarray(feature.weights, dtype=np.float32)
        if spec.weighted:
            if w.shape[0] != ids.shape[0]:
                raise InvalidRequest(f"sparse feature {name!r}: {w.shape[0]} weights for {ids.shape[0]} ids")
            if w.size and not np.isfinite(w).all():
                raise InvalidRequest(f"sparse feature {name!r}: weights must be finite")
            weights.append(w)
        elif w.size:
            raise InvalidRequest(f"sparse feature {name!r}: weights given, but the model's features are unweighted")
        lengths.append(lens)
        values.append(ids)
    dense = request.dense
    expected = (b, spec.num_dense)
    if spec.num_dense == 0 and not dense.values and dense.rows == 0 and dense.cols == 0:
        dense_t = torch.zeros(b, 0)
    else:
        if (int(dense.rows), int(dense.cols)) != expected:
            raise InvalidRequest(f"dense shape [{dense.rows}, {dense.cols}] does not match [batch_size, {spec.num_dense}] = {list(expected)}")
        d = np.asarray(dense.values, dtype=np.float32)
        if d.shape[0] != b * spec.num_dense:
            raise InvalidRequest(f"dense has {d.shape[0]} values for shape {list(expected)}")
        if d.size and not np.isfinite(d).all():
            raise InvalidRequest("dense values must be finite (no NaN or infinity)")
        dense_t = torch.from_numpy(d.reshape(expected).copy())
    sparse = KeyedJaggedTensor(
        keys=spec.features,
        values=torch.from_numpy(np.concatenate(values)) if values else torch.empty(0, dtype=torch.int64),
        lengths=torch.from_numpy(np.concatenate(lengths)),
        weights=torch.from_numpy(np.concatenate(weights)) if spec.weighted else None,
        stride=b,
    )
    return ParsedRequest(b, dense_t, sparse)


def ids_count(parsed: ParsedRequest) -> int:
    return int(parsed.sparse.values().numel())

