"""Strict validation of prediction requests against a model's manifest.

A request arrives as RequestArrays (numpy arrays, from the wire reader, from a
protobuf message, or from the KServe front), is checked in a few vectorised numpy
passes, and leaves as a ParsedRequest in the model's feature order. Every check
raises InvalidRequest with a message naming the field; nothing invalid reaches a
model or a batch shared with other requests.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from recship.export.artifact import Manifest
from recship.serving import rules
from recship.serving.values import shown  # noqa: F401  (re-exported: the fronts import it from here)
from recship.sparse.ids import first_out_of_range, out_of_range_message


class InvalidRequest(ValueError):
    """The request is malformed; the message names the offending field (ErrorKind.INVALID)."""


class RequestTooLarge(InvalidRequest):
    """The request is over the server's size limit (ErrorKind.TOO_LARGE)."""


class IdOutOfRange(InvalidRequest):
    """An id outside its feature's table (a ``reject`` feature); counted apart in the metrics."""


@dataclass
class ModelSpec:
    """What validation needs from a manifest. ``bounds``: feature -> the exclusive upper bound of its ids where
    that is not its rows (the manifest's id_bound: a managed-collision module remaps them inside the model)."""

    features: List[str]
    rows: Dict[str, int]
    modulo: Dict[str, bool]
    weighted: Dict[str, bool]  # feature -> takes a weight (score) per id
    num_dense: int
    max_batch_size: int
    bounds: Dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {name: i for i, name in enumerate(self.features)}
        self._rows = np.array([self.rows[f] for f in self.features], dtype=np.int64)
        self._bounds = np.array([self.bound(f) for f in self.features], dtype=np.int64)
        self._modulo = np.array([self.modulo[f] for f in self.features], dtype=bool)
        self._weighted = np.array([self.weighted[f] for f in self.features], dtype=bool)
        self.any_weighted = bool(self._weighted.any())

    def bound(self, feature: str) -> int:
        """A ``reject`` feature's ids lie in [0, bound)."""
        return self.bounds.get(feature, self.rows[feature])

    @staticmethod
    def from_manifest(manifest: Manifest, max_batch_size: int) -> "ModelSpec":
        """The request contract of the artifact whose manifest this is."""
        feats = manifest.sparse_features
        return ModelSpec(
            features=[f.name for f in feats],
            rows={f.name: f.rows for f in feats},
            modulo={f.name: f.id_policy == "modulo" for f in feats},
            weighted={f.name: f.weighted for f in feats},
            num_dense=manifest.num_dense,
            max_batch_size=max_batch_size,
            bounds={f.name: f.id_bound for f in feats if f.id_bound is not None},
        )


def output_shapes(manifest: Manifest) -> Dict[str, List[int]]:
    """Each output's shape from the manifest, -1 for the batch dimension."""
    return {k: [-1, *v.dims] for k, v in manifest.outputs.items()}


def _empty(dtype) -> np.ndarray:
    return np.empty(0, dtype=dtype)


@dataclass
class SparseArrays:
    """A request's sparse features in the request's order, each field concatenated over the features.

    lengths: int32 [sum(length_counts)], ids: int64 [sum(id_counts)], weights: float32
    [sum(weight_counts)]; the *_counts are int64 [F], how many of each belong to each feature.
    """

    names: List[str]
    lengths: np.ndarray
    length_counts: np.ndarray
    ids: np.ndarray
    id_counts: np.ndarray
    weights: np.ndarray
    weight_counts: np.ndarray

    @staticmethod
    def from_features(names: List[str], lengths: Sequence, ids: Sequence, weights: Sequence) -> "SparseArrays":
        """From one array-like per feature for each field (an empty one where a field is not given)."""
        cols = []
        for arrays, dtype in ((lengths, np.int32), (ids, np.int64), (weights, np.float32)):
            parts = [np.asarray(a, dtype=dtype).reshape(-1) for a in arrays]
            counts = np.array([p.size for p in parts], dtype=np.int64)
            cols += [np.concatenate(parts) if parts else _empty(dtype), counts]
        return SparseArrays(list(names), *cols)

    def feature(self, i: int):
        """(lengths, ids, weights) of the request's i-th feature (views)."""
        out = []
        for values, counts in ((self.lengths, self.length_counts), (self.ids, self.id_counts), (self.weights, self.weight_counts)):
            start = int(counts[:i].sum())
            out.append(values[start:start + int(counts[i])])
        return tuple(out)


@dataclass
class RequestArrays:
    """Everything a Predict request carries, as plain values and numpy arrays."""

    model_name: str = ""
    model_version: int = 0
    request_id: str = ""
    batch_size: int = 0
    sparse: SparseArrays = field(default_factory=lambda: SparseArrays.from_features([], [], [], []))
    dense_rows: int = 0
    dense_cols: int = 0
    dense: np.ndarray = field(default_factory=lambda: _empty(np.float32))  # float32 [dense_rows * dense_cols]

    @staticmethod
    def from_message(request: Any) -> "RequestArrays":
        """From a ``recship.serving.v1.PredictRequest`` message (element-wise: the slow path)."""
        feats = list(request.sparse)
        return RequestArrays(
            model_name=request.model_name, model_version=int(request.model_version), request_id=request.request_id,
            batch_size=int(request.batch_size),
            sparse=SparseArrays.from_features(
                [f.name for f in feats], [f.lengths for f in feats], [f.ids for f in feats], [f.weights for f in feats]
            ),
            dense_rows=int(request.dense.rows), dense_cols=int(request.dense.cols),
            dense=np.asarray(request.dense.values, dtype=np.float32),
        )


@dataclass
class ParsedRequest:
    """A validated request in the model's feature order.

    dense: float32 [B, n_dense]; lengths: int32 [F, B]; ids: int64 [sum(lengths)],
    feature-major (ids of modulo features already hashed); weights: float32 like ids (1 for the
    ids of unweighted features) when any feature is weighted, else None;
    id_counts: int64 [F], ids per feature (what validation summed; the batcher's merge uses it).
    """

    batch_size: int
    dense: torch.Tensor
    lengths: torch.Tensor
    ids: torch.Tensor
    weights: Optional[torch.Tensor] = None
    id_counts: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        if self.id_counts is None:
            self.id_counts = self.lengths.sum(1).numpy()


def validate(r: RequestArrays, spec: ModelSpec) -> ParsedRequest:
    b = int(r.batch_size)
    if b <= 0:
        raise InvalidRequest(f"batch_size must be > 0, got {b}")
    if b > spec.max_batch_size:
        raise InvalidRequest(rules.BATCH_TOO_LARGE.say(batch_size=b, max_batch_size=spec.max_batch_size))
    sp = _in_model_order(r.sparse, spec)
    n_features = len(spec.features)
    lengths, ids, weights = sp.lengths, sp.ids, sp.weights
    ok = bool((sp.length_counts == b).all())
    if ok and lengths.size:
        lengths2d = lengths.reshape(n_features, b)
        ok = int(lengths.min()) >= 0 and bool((lengths2d.sum(1, dtype=np.int64) == sp.id_counts).all())
    if ok and ids.size:
        ids, ok = _check_ids(ids, sp.id_counts, spec)
    if ok:
        wanted = np.where(spec._weighted, sp.id_counts, 0)  # a weight per id of weighted features, none for the others
        ok = bool((sp.weight_counts == wanted).all()) and bool(np.isfinite(weights).all())
    if not ok:  # something is wrong: find the first offending feature and say what
        _raise_first_sparse_error(sp, spec, b)
        raise AssertionError("vectorised and per-feature validation disagree")
    dense = _dense(r, spec, b)
    return ParsedRequest(
        b,
        dense,
        _tensor(lengths, np.int32).view(n_features, b),
        _tensor(ids, np.int64),
        _weights(weights, sp.id_counts, spec) if spec.any_weighted else None,
        sp.id_counts,
    )


def _weights(given: np.ndarray, id_counts: np.ndarray, spec: ModelSpec) -> torch.Tensor:
    """float32 [N]: the given weights of weighted features' ids, 1 for the ids of unweighted ones (which ignore them)."""
    if spec._weighted.all():
        return _tensor(given, np.float32)
    out = np.ones(int(id_counts.sum()), dtype=np.float32)
    out[np.repeat(spec._weighted, id_counts)] = given
    return torch.from_numpy(out)


def _tensor(a: np.ndarray, dtype) -> torch.Tensor:
    """A tensor owning its memory (the readers may hand over read-only views of request bytes)."""
    a = np.ascontiguousarray(a, dtype=dtype)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


class _Alias:
    """Presents ``a``'s memory to numpy as writable (``__array_interface__`` with read-only False), holding ``a``."""

    def __init__(self, a: np.ndarray) -> None:
        self.base = a
        self.__array_interface__ = {**a.__array_interface__, "data": (a.__array_interface__["data"][0], False)}


def _writable_alias(a: np.ndarray) -> np.ndarray:
    """``a`` itself if writable, else a writable view of the same memory (no copy), for ``torch.from_numpy``.

    The readers hand over read-only views of the request's own bytes (``np.frombuffer`` on the immutable
    ``bytes`` of a message or body); torch has no read-only tensors, so ``from_numpy`` warns ("The given NumPy
    array is not writable") on every such request. Only for tensors nothing writes: the caller must only read
    (``first_out_of_range`` computes a min and a max) and drop the tensor before the request's bytes go."""
    return a if a.flags.writeable else np.asarray(_Alias(a))


def _in_model_order(sp: SparseArrays, spec: ModelSpec) -> SparseArrays:
    seen = set()
    for name in sp.names:
        if name in seen:
            raise InvalidRequest(f"sparse feature {shown(name)} appears twice")
        if name not in spec._index:
            raise InvalidRequest(f"unknown sparse feature {shown(name)}; the model takes {spec.features}")
        seen.add(name)
    if len(seen) != len(spec.features):
        raise InvalidRequest(f"missing sparse features {[f for f in spec.features if f not in seen]}")
    if sp.names == spec.features:
        return sp
    position = {name: i for i, name in enumerate(sp.names)}
    order = [position[f] for f in spec.features]
    cols = []
    for values, counts in ((sp.lengths, sp.length_counts), (sp.ids, sp.id_counts), (sp.weights, sp.weight_counts)):
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        cols += [np.concatenate([values[starts[i]:starts[i] + counts[i]] for i in order]), counts[order]]
    return SparseArrays(list(spec.features), *cols)


def _check_ids(ids: np.ndarray, id_counts: np.ndarray, spec: ModelSpec):
    """(ids with modulo features hashed, all in range?)."""
    if spec._modulo.any():  # a modulo feature has no id_bound (check_manifest): its bound is its rows
        hashed = np.mod(ids, np.repeat(spec._rows, id_counts))
        ids = np.where(np.repeat(spec._modulo, id_counts), hashed, ids)
        return ids, bool(((ids >= 0) & (ids < np.repeat(spec._bounds, id_counts))).all())
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < int(spec._bounds.min()):  # every id fits the smallest bound: no per-id bounds needed
        return ids, True
    return ids, lo >= 0 and bool((ids < np.repeat(spec._bounds, id_counts)).all())


def _raise_first_sparse_error(sp: SparseArrays, spec: ModelSpec, b: int) -> None:
    """Checks feature by feature, in the model's order, and raises for the first problem found."""
    for i, name in enumerate(spec.features):
        lens, ids, w = sp.feature(i)
        if lens.shape[0] != b:
            raise InvalidRequest(f"sparse feature {name!r}: {lens.shape[0]} lengths for batch_size {b}")
        if lens.size and int(lens.min()) < 0:
            raise InvalidRequest(f"sparse feature {name!r}: negative length {int(lens.min())}")
        if int(lens.sum(dtype=np.int64)) != ids.shape[0]:
            raise InvalidRequest(f"sparse feature {name!r}: sum(lengths) = {int(lens.sum(dtype=np.int64))} but {ids.shape[0]} ids")
        bound = spec.bound(name)
        bad = None if spec.modulo[name] else first_out_of_range(torch.from_numpy(_writable_alias(ids)), bound)
        if bad is not None:
            raise IdOutOfRange(out_of_range_message(name, bad, bound))
        if spec.weighted[name]:
            if w.shape[0] != ids.shape[0]:
                raise InvalidRequest(f"sparse feature {name!r}: {w.shape[0]} weights for {ids.shape[0]} ids")
            if w.size and not np.isfinite(w).all():
                raise InvalidRequest(f"sparse feature {name!r}: weights must be finite")
        elif w.size:
            whose = "this feature is" if spec.any_weighted else "the model's features are"
            raise InvalidRequest(f"sparse feature {name!r}: weights given, but {whose} unweighted")


def _dense(r: RequestArrays, spec: ModelSpec, b: int) -> torch.Tensor:
    expected = (b, spec.num_dense)
    if spec.num_dense == 0 and r.dense.size == 0 and r.dense_rows == 0 and r.dense_cols == 0:
        return torch.zeros(b, 0)
    if (int(r.dense_rows), int(r.dense_cols)) != expected:
        raise InvalidRequest(f"dense shape [{r.dense_rows}, {r.dense_cols}] does not match [batch_size, {spec.num_dense}] = {list(expected)}")
    if r.dense.shape[0] != b * spec.num_dense:
        raise InvalidRequest(f"dense has {r.dense.shape[0]} values for shape {list(expected)}")
    if r.dense.size and not np.isfinite(r.dense).all():
        raise InvalidRequest("dense values must be finite (no NaN or infinity)")
    return _tensor(r.dense, np.float32).view(expected)
