"""Training data as batches of (dense, sparse KJT, labels).

- ``SyntheticCriteo``: Criteo-shaped data (13 log-normal dense features, 26
  categorical features with Zipf-distributed ids and multi-hot lengths) whose
  labels come from a fixed hidden model, so training really lowers the loss.
  Batch ``i`` of rank ``r`` is a pure function of (seed, i, r): any position can be
  regenerated, which is what makes resume exact.
- ``CriteoTSV``: the real Criteo format (label, 13 integers, 26 hex ids, tab
  separated, empty fields allowed); ids are hashed into each table's rows.
  Malformed lines are skipped: the first few of a file are logged with their line numbers, and
  each pass over the file ends with one warning giving the total.
- ``prefetch``: a background thread keeps the next batches ready.
"""

import logging
import math
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Generator, Iterator, List, Optional, TypeVar, Union

import torch

from recship.names import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from recship.sparse import KeyedJaggedTensor
from recship.trainer.entry_point import load_factory

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """dense [B, num_dense] float32, sparse KJT (B examples), labels [B] float32 in {0, 1}, or [B, T] for T tasks
    (a data function's; the model's ``loss`` gets them as they are, ``eval_outputs`` names each task's column)."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def __len__(self) -> int:
        return self.labels.shape[0]


@dataclass
class SyntheticConfig:
    """Synthetic Criteo-like data.

    Args:
        num_embeddings_per_feature: cardinality of each categorical feature.
        num_dense: dense features.
        batch_size: examples per batch (per rank).
        max_ids_per_feature: multi-hot lengths are uniform in [1, max] (0 allowed with
            probability ``empty_prob``).
        zipf_alpha: skew of the id distribution (rank k drawn with weight 1/k^alpha).
        seed: everything, including the hidden labelling model, follows from it.
    """

    num_embeddings_per_feature: List[int]
    num_dense: int = 13
    batch_size: int = 256
    max_ids_per_feature: int = 3
    empty_prob: float = 0.05
    zipf_alpha: float = 1.05
    seed: int = 0
    weighted: bool = False  # give every id a score in [0, 1) (for weighted, id-score features)


class SyntheticCriteo:
    """Deterministic synthetic batches; ``batch(i, rank)`` is a pure function."""

    def __init__(self, config: SyntheticConfig, feature_names: Optional[List[str]] = None) -> None:
        self.config = config
        n = len(config.num_embeddings_per_feature)
        self.feature_names = feature_names or [f"cat_{i}" for i in range(n)]
        g = torch.Generator().manual_seed(config.seed)
        # The hidden model: a weight per dense feature and a score per id.
        self._dense_weight = torch.randn(config.num_dense, generator=g) * 0.5
        self._id_scores = [torch.randn(rows, generator=g) for rows in config.num_embeddings_per_feature]
        # Zipf over ids, through a fixed random permutation so popular ids are spread out.
        self._zipf_cdf = []
        self._perm = []
        cdfs: Dict[int, torch.Tensor] = {}  # tables of one size share theirs (each is costly at 1M rows)
        for rows in config.num_embeddings_per_feature:
            if rows not in cdfs:
                w = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** config.zipf_alpha
                cdfs[rows] = torch.cumsum(w / w.sum(), 0)
            self._zipf_cdf.append(cdfs[rows])
            self._perm.append(torch.randperm(rows, generator=g))

    def batch(self, index: int, rank: int = 0, batch_size: Optional[int] = None) -> Batch:
        """Batch ``index`` of stream ``rank``, of ``batch_size`` examples (default: the config's)."""
        c = self.config
        g = torch.Generator().manual_seed(((c.seed * 1_000_003 + index) * 10_007 + rank) % (2**63))
        b = c.batch_size if batch_size is None else batch_size
        dense = torch.exp(torch.randn(b, c.num_dense, generator=g) * 0.8).floor()
        logit = (torch.log1p(dense) - 1.0) @ self._dense_weight
        lengths, values = [], []
        for f, rows in enumerate(c.num_embeddings_per_feature):
            n = torch.randint(1, c.max_ids_per_feature + 1, (b,), generator=g)
            n[torch.rand(b, generator=g) < c.empty_prob] = 0
            u = torch.rand(int(n.sum()), generator=g, dtype=torch.float64)
            ranks = torch.searchsorted(self._zipf_cdf[f], u).clamp(max=rows - 1)
            ids = self._perm[f][ranks]
            example = torch.repeat_interleave(torch.arange(b), n)
            logit = logit + torch.zeros(b).index_add_(0, example, self._id_scores[f][ids]) / math.sqrt(len(self._id_scores))
            lengths.append(n)
            values.append(ids)
        labels = (torch.rand(b, generator=g) < torch.sigmoid(logit)).float()
        ids = torch.cat(values)
        weights = torch.rand(ids.numel(), generator=g) if c.weighted else None
        sparse = KeyedJaggedTensor(
            keys=self.feature_names, values=ids, lengths=torch.cat(lengths).to(torch.int32), weights=weights
        )
        return Batch(dense=torch.log1p(dense), sparse=sparse, labels=labels)

    def batches(self, start: int = 0, stop: Optional[int] = None, rank: int = 0) -> Iterator[Batch]:
        i = start
        while stop is None or i < stop:
            yield self.batch(i, rank)
            i += 1


class CriteoTSV:
    """Reads Criteo TSV lines into batches.

    Each line: label, 13 integer features, 26 hexadecimal categorical ids, tab
    separated; empty fields mean "missing" (dense 0, no id). Integer features are
    log(1 + max(x, 0)) transformed; ids are int(hex, 16) % rows of their table.

    Args:
        path: the file.
        num_embeddings_per_feature: rows of each of the 26 tables.
        batch_size: examples per batch; the last batch may be smaller.
        rank, world_size: this rank reads lines i with i % world_size == rank.
    """

    NUM_DENSE = CRITEO_NUM_DENSE
    NUM_SPARSE = CRITEO_NUM_SPARSE

    def __init__(
        self,
        path: Union[str, Path],
        num_embeddings_per_feature: List[int],
        batch_size: int = 256,
        rank: int = 0,
        world_size: int = 1,
        feature_names: Optional[List[str]] = None,
    ) -> None:
        if len(num_embeddings_per_feature) != self.NUM_SPARSE:
            raise ValueError(f"Criteo has {self.NUM_SPARSE} categorical features, got {len(num_embeddings_per_feature)} table sizes")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"Criteo file not found: {self.path}")
        self.rows = num_embeddings_per_feature
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.feature_names = feature_names or [f"cat_{i}" for i in range(self.NUM_SPARSE)]
        self.malformed = 0  # malformed lines (of this rank's share) in the current or last pass
        self._passes = 0

    def _parse(self, line: str, number: int):
        fields = line.rstrip("\n").split("\t")
        if len(fields) != 1 + self.NUM_DENSE + self.NUM_SPARSE:
            raise ValueError(f"{len(fields)} fields, expected {1 + self.NUM_DENSE + self.NUM_SPARSE}")
        label = int(fields[0])
        if label not in (0, 1):
            raise ValueError(f"label {label} is not 0 or 1")
        dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1 : 1 + self.NUM_DENSE]]
        ids = [
            [int(x, 16) % rows] if x else []
            for x, rows in zip(fields[1 + self.NUM_DENSE :], self.rows)
        ]
        return label, dense, ids

    SHOWN_MALFORMED = 5  # malformed lines logged one by one, in the first pass only; the rest are counted

    def __iter__(self) -> Iterator[Batch]:
        self.malformed = 0
        self._passes += 1
        labels, dense, ids = [], [], []
        read = 0
        try:
            with self.path.open() as f:
                for number, line in enumerate(f, start=1):
                    if (number - 1) % self.world_size != self.rank:
                        continue
                    read += 1
                    try:
                        label, d, i = self._parse(line, number)
                    except ValueError as e:
                        self.malformed += 1
                        if self._passes == 1 and self.malformed <= self.SHOWN_MALFORMED:
                            more = "; further ones are counted, not shown" if self.malformed == self.SHOWN_MALFORMED else ""
                            log.warning("%s:%d: skipping malformed line (%s)%s", self.path, number, e, more)
                        continue
                    labels.append(label)
                    dense.append(d)
                    ids.append(i)
                    if len(labels) == self.batch_size:
                        yield self._batch(labels, dense, ids)
                        labels, dense, ids = [], [], []
            if labels:
                yield self._batch(labels, dense, ids)
        finally:  # the end of the pass, or a reader that stopped early (an evaluation's few batches)
            if self.malformed:
                log.warning("%s: skipped %d malformed line(s) of the %d read in pass %d over the file", self.path, self.malformed, read, self._passes)

    def _batch(self, labels, dense, ids) -> Batch:
        lengths = [len(example[f]) for f in range(self.NUM_SPARSE) for example in ids]
        values = [v for f in range(self.NUM_SPARSE) for example in ids for v in example[f]]
        return Batch(
            dense=torch.tensor(dense, dtype=torch.float32),
            sparse=KeyedJaggedTensor(
                keys=self.feature_names,
                values=torch.tensor(values, dtype=torch.int64),
                lengths=torch.tensor(lengths, dtype=torch.int32),
            ),
            labels=torch.tensor(labels, dtype=torch.float32),
        )


T = TypeVar("T")


def prefetch(batches: Iterator[T], depth: int = 4) -> Generator[T, None, None]:
    """Produces batches in a background thread, ``depth`` ahead, so loading overlaps training.

    Closing the returned generator (or dropping it) stops the thread after the batch it is making:
    a run that fails does not leave it working while the process exits.
    """
    q: "queue.Queue" = queue.Queue(maxsize=depth)
    done = object()
    failure: List[BaseException] = []
    stop = threading.Event()

    def produce() -> None:
        try:
            for b in batches:
                while not stop.is_set():
                    try:
                        q.put(b, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # re-raised in the consumer
            failure.append(e)
        finally:
            if not stop.is_set():
                q.put(done)

    thread = threading.Thread(target=produce, daemon=True, name="recship-prefetch")
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                if failure:
                    raise failure[0]
                return
            yield item
    finally:
        stop.set()
        thread.join(timeout=30)


def is_entry_point(data: str) -> bool:
    """``package.module:function`` rather than a file path."""
    return ":" in data and not Path(data).exists() and "/" not in data.split(":", 1)[0]


class DataFunction:
    """Batches from a user's function: ``function(batch_size=B, rank=r, world_size=W)`` returns an
    iterable of ``(dense [B, num_dense] float, KeyedJaggedTensor of the model's features, labels [B] or [B, T])``
    (or Batch objects) holding this rank's share of the data. Iterating again calls it again. Labels [B, 1] become
    [B]; [B, T] (T tasks) stay as they are.
    """

    def __init__(self, entry: str, batch_size: int, rank: int, world_size: int, features: List[str], weighted: bool) -> None:
        self.path = entry
        self._function: Callable[..., Any] = load_factory(entry)
        self._kwargs = {"batch_size": batch_size, "rank": rank, "world_size": world_size}
        self._features, self._weighted = list(features), weighted

    def __iter__(self) -> Iterator[Batch]:
        for item in self._function(**self._kwargs):
            b = item if isinstance(item, Batch) else Batch(*item)
            if list(b.sparse.keys()) != self._features:
                raise ValueError(f"{self.path}: batches must have the model's features {self._features}, in order; got {b.sparse.keys()}")
            if self._weighted and b.sparse.weights_or_none() is None:
                raise ValueError(f"{self.path}: the model has weighted features; the batches' KeyedJaggedTensor has no weights")
            yield Batch(b.dense.float(), b.sparse, task_labels(b.labels, b.dense.shape[0], self.path))


def task_labels(labels: torch.Tensor, batch: int, source: str) -> torch.Tensor:
    """``labels`` as float32 [B] (one task: [B] or [B, 1]) or [B, T] (T > 1 tasks); ValueError naming ``source``
    and the shapes for anything else."""
    labels = torch.as_tensor(labels)
    if labels.dim() == 2 and labels.shape[1] == 1:
        labels = labels.reshape(-1)
    if labels.dim() not in (1, 2) or labels.shape[0] != batch:
        raise ValueError(f"{source}: labels must be [B] or [B, T] for a batch of B = {batch}, got {list(labels.shape)}")
    return labels.float()
