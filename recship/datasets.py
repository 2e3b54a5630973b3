"""TorchRec's ``torchrec.datasets`` (the import map sends every ``torchrec.datasets`` path here, one flat module):

- ``criteo``: the Criteo layout constants, ``CriteoIterDataPipe`` / ``criteo_terabyte`` / ``criteo_kaggle`` (rows of
  the Criteo TSV files as {column: value} dicts);
- ``movielens``: ``movielens_20m`` / ``movielens_25m`` (rows of a local MovieLens folder's ratings.csv, optionally
  joined with movies.csv);
- ``utils``: ``Batch``, the datapipes ``LoadFiles`` / ``ReadLinesFromCSV`` / ``Limit`` / ``ParallelReadConcat``,
  the train/validation splits ``idx_split_train_val`` / ``rand_split_train_val`` (``train_filter``,
  ``val_filter``) and ``safe_cast``;
- ``random``: ``RandomRecDataset``, whose batches are TorchRec's, draw for draw, for the same ``manual_seed``.

The datapipes are torch's ``IterDataPipe`` (``.map``, ``.limit`` chain as in TorchRec). Files are local paths opened
with ``open`` (TorchRec opens them through iopath; ``path_manager_key`` is accepted and unused). Being one module,
it holds criteo's ``DEFAULT_COLUMN_NAMES`` and ``COLUMN_TYPE_CASTERS``; MovieLens's are
``DEFAULT_RATINGS_COLUMN_NAMES + DEFAULT_MOVIES_COLUMN_NAMES[1:]`` and ``MOVIELENS_COLUMN_TYPE_CASTERS``.
recship's own Criteo reader for training is ``recship.trainer.data.CriteoTSV`` (what ``recship train --data FILE``
reads). Not here: TorchRec's preprocessed-binary Criteo pipeline (``BinaryCriteoUtils``,
``InMemoryBinaryCriteoIterDataPipe``) and its preprocessing scripts.
"""

import csv
import math
import os
import random
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

import torch
from torch.utils.data import IterableDataset, IterDataPipe, functional_datapipe, get_worker_info

from recship.names import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from recship.sparse import KeyedJaggedTensor, Pipelineable

if TYPE_CHECKING:
    from io import IOBase

# ---------------------------------------------------------------------------------------------------------------
# utils
# ---------------------------------------------------------------------------------------------------------------

PATH_MANAGER_KEY = "torchrec"  # TorchRec's iopath key (accepted by LoadFiles; recship opens local paths)
T = TypeVar("T")


@dataclass
class Batch(Pipelineable):
    """One training batch as TorchRec's examples pass it (``torchrec.datasets.utils.Batch``): dense features
    [B, num_dense], sparse features (a KeyedJaggedTensor of B examples), labels [B]."""

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(self.dense_features.to(device, non_blocking=non_blocking),
                     self.sparse_features.to(device, non_blocking=non_blocking), self.labels.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(self.dense_features.pin_memory(), self.sparse_features.pin_memory(), self.labels.pin_memory())


def safe_cast(val: T, dest_type: Callable[[T], T], default: T) -> T:
    """``dest_type(val)``, or ``default`` when that is a ValueError (an empty Criteo cell)."""
    try:
        return dest_type(val)
    except ValueError:
        return default


def train_filter(key_fn: Callable[[int], int], train_perc: float, decimal_places: int, idx: int) -> bool:
    """Whether sample ``idx`` is in the training split: the last ``decimal_places`` digits of ``key_fn(idx)`` fall
    below ``train_perc`` of their range."""
    return (key_fn(idx) % 10**decimal_places) < round(train_perc * 10**decimal_places)


def val_filter(key_fn: Callable[[int], int], train_perc: float, decimal_places: int, idx: int) -> bool:
    """Whether sample ``idx`` is in the validation split (not ``train_filter``)."""
    return not train_filter(key_fn, train_perc, decimal_places, idx)


class _IdxFilter(IterDataPipe):
    def __init__(self, datapipe: IterDataPipe, filter_fn: Callable[[int], bool]) -> None:
        super().__init__()
        self.datapipe = datapipe
        self.filter_fn = filter_fn

    def __iter__(self) -> Iterator[Any]:
        for idx, data in enumerate(self.datapipe):
            if self.filter_fn(idx):
                yield data


def _identity(idx: int) -> int:
    return idx


def _check_perc(train_perc: float) -> None:
    if not 0.0 < train_perc < 1.0:
        raise ValueError(f"train_perc must be in range (0.0, 1.0), got {train_perc}")


def idx_split_train_val(datapipe: IterDataPipe, train_perc: float, decimal_places: int = 2,
                        key_fn: Callable[[int], int] = _identity) -> Tuple[IterDataPipe, IterDataPipe]:
    """(train, validation) datapipes over ``datapipe``, split by each sample's index (``train_filter``): with the
    default 2 decimal places and train_perc 0.75, samples 0-74 of every hundred train, 75-99 validate."""
    _check_perc(train_perc)
    return (_IdxFilter(datapipe, partial(train_filter, key_fn, train_perc, decimal_places)),
            _IdxFilter(datapipe, partial(val_filter, key_fn, train_perc, decimal_places)))


class _RandFilter(IterDataPipe):
    """Keeps the samples for which ``filter_fn(rng)`` holds, the rng restarted from its seed on every pass."""

    def __init__(self, datapipe: IterDataPipe, filter_fn: Callable[[random.Random], bool], rand_gen: random.Random) -> None:
        super().__init__()
        self.datapipe = datapipe
        self.filter_fn = filter_fn
        self.rand_gen = rand_gen
        self.rand_gen_init_state: Tuple[Any, ...] = rand_gen.getstate()

    def __iter__(self) -> Iterator[Any]:
        self.rand_gen.setstate(self.rand_gen_init_state)
        for data in self.datapipe:
            if self.filter_fn(self.rand_gen):
                yield data


def _rand_is_train(train_perc: float, rng: random.Random) -> bool:
    return rng.random() < train_perc


def _rand_is_val(train_perc: float, rng: random.Random) -> bool:
    return not _rand_is_train(train_perc, rng)


def rand_split_train_val(datapipe: IterDataPipe, train_perc: float, random_seed: int = 0) -> Tuple[IterDataPipe, IterDataPipe]:
    """(train, validation) datapipes over ``datapipe``: sample i trains when the i-th draw of
    ``random.Random(random_seed)`` is below ``train_perc`` (so the splits are disjoint, cover every sample, and are
    the same on every pass and for the same seed)."""
    _check_perc(train_perc)
    return (_RandFilter(datapipe, partial(_rand_is_train, train_perc), random.Random(random_seed)),
            _RandFilter(datapipe, partial(_rand_is_val, train_perc), random.Random(random_seed)))


@functional_datapipe("limit")
class Limit(IterDataPipe):
    """The first ``limit`` samples of ``datapipe`` (``datapipe.limit(n)``)."""

    def __init__(self, datapipe: IterDataPipe, limit: int) -> None:
        super().__init__()
        self.datapipe = datapipe
        self.limit = limit

    def __iter__(self) -> Iterator[Any]:
        for idx, data in enumerate(self.datapipe):
            if idx >= self.limit:
                break
            yield data


class ReadLinesFromCSV(IterDataPipe):
    """The rows (lists of strings) of each file that ``datapipe`` yields as ``(path, open file)``; ``**kw`` go to
    ``csv.reader`` (``delimiter="\t"`` for TSV); ``skip_first_line`` drops each file's header."""

    def __init__(self, datapipe: "IterDataPipe[Tuple[str, IOBase]]", skip_first_line: bool = False, **kw: Any) -> None:
        super().__init__()
        self.datapipe = datapipe
        self.skip_first_line = skip_first_line
        self.kw = kw

    def __iter__(self) -> Iterator[List[str]]:
        for _, data in self.datapipe:
            reader = csv.reader(data, **self.kw)
            if self.skip_first_line:
                next(reader, None)
            yield from reader


class LoadFiles(IterDataPipe):
    """``(path, open file)`` for each local path of ``datapipe``, opened with ``mode`` ("b", "t", "rb", "rt" or "r")
    and ``**open_kw``; ``length`` is what ``len()`` answers (-1: unknown). ``path_manager_key`` is TorchRec's iopath
    key, accepted and unused: recship opens local paths only."""

    def __init__(self, datapipe: Iterable[str], mode: str = "b", length: int = -1,
                 path_manager_key: str = PATH_MANAGER_KEY, **open_kw: Any) -> None:
        super().__init__()
        if mode not in ("b", "t", "rb", "rt", "r"):
            raise ValueError(f"Invalid mode {mode!r}: one of 'b', 't', 'rb', 'rt', 'r'")
        self.datapipe: Iterable[str] = datapipe
        self.mode = "r" + mode if mode in ("b", "t") else mode
        self.length = length
        self.open_kw = open_kw

    def __iter__(self) -> Iterator[Tuple[str, Any]]:
        for pathname in self.datapipe:
            if not isinstance(pathname, str):
                raise TypeError(f"Expected string type for pathname, but got {type(pathname)}")
            if "://" in pathname:
                raise ValueError(f"{pathname}: recship's LoadFiles opens local paths only (TorchRec's goes through iopath)")
            yield pathname, open(pathname, self.mode, **self.open_kw)

    def __len__(self) -> int:
        if self.length == -1:
            raise TypeError("LoadFiles was given no length")
        return self.length


def _default_dp_selector(datapipes: Sequence[IterDataPipe]) -> Sequence[IterDataPipe]:
    """The datapipes this DataLoader worker reads: all outside a worker, else a contiguous share (as even as the
    counts allow, the first workers taking the larger shares)."""
    worker_info = get_worker_info()
    if worker_info is None:
        return datapipes
    if worker_info.num_workers > len(datapipes):
        raise ValueError(f"Number of workers {worker_info.num_workers} exceeds number of datapipes ({len(datapipes)})!")
    offsets = [0]
    for workers_left in reversed(range(1, worker_info.num_workers + 1)):
        offsets.append(offsets[-1] + math.ceil((len(datapipes) - offsets[-1]) / workers_left))
    return datapipes[offsets[worker_info.id]: offsets[worker_info.id + 1]]


class ParallelReadConcat(IterDataPipe):
    """``datapipes`` one after the other; under a DataLoader with workers, each worker reads its share
    (``dp_selector``, default: contiguous shares)."""

    def __init__(self, *datapipes: IterDataPipe,
                 dp_selector: Callable[[Sequence[IterDataPipe]], Sequence[IterDataPipe]] = _default_dp_selector) -> None:
        super().__init__()
        self.datapipes: Tuple[IterDataPipe, ...] = datapipes
        self.dp_selector = dp_selector

    def __iter__(self) -> Iterator[Any]:
        for dp in self.dp_selector(self.datapipes):
            yield from dp


# ---------------------------------------------------------------------------------------------------------------
# criteo: a line is the label, 13 integer features, 26 categorical ones (hex strings)
# ---------------------------------------------------------------------------------------------------------------

FREQUENCY_THRESHOLD = 3
INT_FEATURE_COUNT = CRITEO_NUM_DENSE
CAT_FEATURE_COUNT = CRITEO_NUM_SPARSE
DAYS = 24
TOTAL_TRAINING_SAMPLES = 4195197692  # the Criteo 1TB rows of days 0-22 (day 23 validates and tests)
DEFAULT_LABEL_NAME = "label"
DEFAULT_INT_NAMES: List[str] = [f"int_{i}" for i in range(INT_FEATURE_COUNT)]
DEFAULT_CAT_NAMES: List[str] = [f"cat_{i}" for i in range(CAT_FEATURE_COUNT)]
DEFAULT_COLUMN_NAMES: List[str] = [DEFAULT_LABEL_NAME, *DEFAULT_INT_NAMES, *DEFAULT_CAT_NAMES]


def _int_or_0(val: Any) -> Any:
    return safe_cast(val, int, 0)


def _str_or_empty(val: Any) -> Any:
    return safe_cast(val, str, "")


def _float_or_0(val: Any) -> Any:
    return safe_cast(val, float, 0.0)


COLUMN_TYPE_CASTERS: List[Callable[[Union[int, str]], Union[int, str]]] = [
    _int_or_0, *([_int_or_0] * INT_FEATURE_COUNT), *([_str_or_empty] * CAT_FEATURE_COUNT)]


def _criteo_row(example: List[str]) -> Dict[str, Union[int, str]]:
    """A split Criteo line as {column: value}, matched from the last column back, so a test-set line (no label)
    maps its 39 values to the features."""
    names, casters = DEFAULT_COLUMN_NAMES[::-1], COLUMN_TYPE_CASTERS[::-1]
    return {names[i]: casters[i](val) for i, val in enumerate(reversed(example))}


class CriteoIterDataPipe(IterDataPipe):
    """The lines of Criteo TSV files (the 1TB Click Logs' days, or Kaggle's train.txt / test.txt), each split on tabs
    and passed through ``row_mapper`` (default: {"label": int, "int_i": int (0 when empty), "cat_i": str}; None:
    the list of strings). Under a DataLoader with workers, worker k reads the files k, k + workers, ...
    ``**open_kw`` go to ``open``."""

    def __init__(self, paths: Iterable[str], *, row_mapper: Optional[Callable[[List[str]], Any]] = _criteo_row,
                 **open_kw: Any) -> None:
        super().__init__()
        self.paths = paths
        self.row_mapper = row_mapper
        self.open_kw = open_kw

    def __iter__(self) -> Iterator[Any]:
        worker_info = get_worker_info()
        paths: Iterable[str] = self.paths
        if worker_info is not None:
            paths = [p for i, p in enumerate(paths) if i % worker_info.num_workers == worker_info.id]
        rows = ReadLinesFromCSV(LoadFiles(paths, mode="r", **self.open_kw), delimiter="\t")
        for row in rows:
            yield self.row_mapper(row) if self.row_mapper else row


def criteo_terabyte(paths: Iterable[str], *, row_mapper: Optional[Callable[[List[str]], Any]] = _criteo_row,
                    **open_kw: Any) -> IterDataPipe:
    """The Criteo 1TB Click Logs' day files ``paths`` (``day_0`` ... as TSV) as a CriteoIterDataPipe."""
    return CriteoIterDataPipe(paths, row_mapper=row_mapper, **open_kw)


def criteo_kaggle(path: str, *, row_mapper: Optional[Callable[[List[str]], Any]] = _criteo_row,
                  **open_kw: Any) -> IterDataPipe:
    """The Kaggle/Criteo Display Advertising file ``path`` (train.txt, or test.txt whose lines have no label) as a
    CriteoIterDataPipe."""
    return CriteoIterDataPipe((path,), row_mapper=row_mapper, **open_kw)


# ---------------------------------------------------------------------------------------------------------------
# movielens: a folder holding ratings.csv (userId,movieId,rating,timestamp) and movies.csv (movieId,title,genres)
# ---------------------------------------------------------------------------------------------------------------

RATINGS_FILENAME = "ratings.csv"
MOVIES_FILENAME = "movies.csv"
DEFAULT_RATINGS_COLUMN_NAMES: List[str] = ["userId", "movieId", "rating", "timestamp"]
DEFAULT_MOVIES_COLUMN_NAMES: List[str] = ["movieId", "title", "genres"]
MOVIELENS_COLUMN_NAMES: List[str] = DEFAULT_RATINGS_COLUMN_NAMES + DEFAULT_MOVIES_COLUMN_NAMES[1:]
MOVIELENS_COLUMN_TYPE_CASTERS: List[Callable[[Union[float, int, str]], Union[float, int, str]]] = [
    _int_or_0, _int_or_0, _float_or_0, _int_or_0, _str_or_empty, _str_or_empty]


def _movielens_row(example: List[str]) -> Dict[str, Union[float, int, str]]:
    """A ratings row (joined with its movie's title and genres, when asked) as {column: value}."""
    return {MOVIELENS_COLUMN_NAMES[i]: MOVIELENS_COLUMN_TYPE_CASTERS[i](val) for i, val in enumerate(example)}


def _join_movie(movie_by_id: Dict[str, List[str]], root: str, row: List[str]) -> List[str]:
    """A ratings row followed by its movie's title and genres."""
    if row[1] not in movie_by_id:
        raise ValueError(f"{root}/{RATINGS_FILENAME}: movieId {row[1]!r} is not in {MOVIES_FILENAME}")
    return row + movie_by_id[row[1]]


def _movielens(root: str, include_movies_data: bool, row_mapper: Optional[Callable[[List[str]], Any]],
               **open_kw: Any) -> IterDataPipe:
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such MovieLens folder (it holds {RATINGS_FILENAME} and {MOVIES_FILENAME})")
    datapipe: IterDataPipe = ReadLinesFromCSV(LoadFiles((os.path.join(root, RATINGS_FILENAME),), mode="r", **open_kw),
                                              skip_first_line=True, delimiter=",")
    if include_movies_data:
        movies = ReadLinesFromCSV(LoadFiles((os.path.join(root, MOVIES_FILENAME),), mode="r"), skip_first_line=True,
                                  delimiter=",")
        movie_by_id: Dict[str, List[str]] = {row[0]: row[1:] for row in movies}
        datapipe = datapipe.map(partial(_join_movie, movie_by_id, root))
    if row_mapper:
        datapipe = datapipe.map(row_mapper)
    return datapipe


def movielens_20m(root: str, *, include_movies_data: bool = False,
                  row_mapper: Optional[Callable[[List[str]], Any]] = _movielens_row, **open_kw: Any) -> IterDataPipe:
    """The ratings of the MovieLens 20M folder ``root`` (files as grouplens ships them; nothing is downloaded), one
    {"userId": int, "movieId": int, "rating": float, "timestamp": int} per row, with "title" and "genres" when
    ``include_movies_data``; ``row_mapper=None`` gives the rows as lists of strings."""
    return _movielens(root, include_movies_data, row_mapper, **open_kw)


def movielens_25m(root: str, *, include_movies_data: bool = False,
                  row_mapper: Optional[Callable[[List[str]], Any]] = _movielens_row, **open_kw: Any) -> IterDataPipe:
    """As ``movielens_20m``, for the MovieLens 25M folder ``root`` (the same files and columns)."""
    return _movielens(root, include_movies_data, row_mapper, **open_kw)


# ---------------------------------------------------------------------------------------------------------------
# random
# ---------------------------------------------------------------------------------------------------------------


class RandomRecDataset(IterableDataset):
    """Random batches (``torchrec.datasets.random.RandomRecDataset``), drawn as TorchRec draws them, so the same
    ``manual_seed`` gives TorchRec's batches: for each key, B lengths uniform in [min_ids, ids] (int32) then their ids
    uniform in [0, hash size); then dense features [B, num_dense] standard normal; then labels [B], 0 or 1.

    Args:
        keys: the sparse features.
        batch_size: B.
        hash_size / hash_sizes: ids' range, one for all keys or one per key (default 100).
        ids_per_feature / ids_per_features: the most ids an example has per key (default 2).
        min_ids_per_feature / min_ids_per_features: the fewest (default: ``ids_per_feature`` when given, so every
            example has exactly that many; else 0).
        num_dense: dense width.
        manual_seed: seeds a generator of its own; None draws from torch's global generator (``torch.manual_seed``).
        num_batches: batches per pass (None: endless).
        num_generated_batches: batches drawn up front and repeated in turn; a negative number draws a new batch every
            time.
        is_weighted: (recship) the KJT gets a weight per id, uniform in [0, 1), drawn after the labels.

    Labels are float32 (TorchRec's are int64 with the same values), as losses take them.
    """

    def __init__(self, keys: List[str], batch_size: int, hash_size: Optional[int] = None,
                 hash_sizes: Optional[List[int]] = None, ids_per_feature: Optional[int] = None,
                 ids_per_features: Optional[List[int]] = None, num_dense: int = 50, manual_seed: Optional[int] = None,
                 num_batches: Optional[int] = None, num_generated_batches: int = 10,
                 min_ids_per_feature: Optional[int] = None, min_ids_per_features: Optional[List[int]] = None,
                 is_weighted: bool = False) -> None:
        super().__init__()
        sizes = list(hash_sizes) if hash_sizes is not None else [hash_size if hash_size else 100] * len(keys)
        most = list(ids_per_features) if ids_per_features is not None else [ids_per_feature if ids_per_feature else 2] * len(keys)
        if min_ids_per_features is None:
            fewest = min_ids_per_feature if min_ids_per_feature is not None else ids_per_feature
            min_ids_per_features = [fewest if fewest else 0] * len(keys)
        least = list(min_ids_per_features)
        if not len(sizes) == len(most) == len(least) == len(keys):
            raise ValueError(f"RandomRecDataset: {len(keys)} keys need as many hash sizes, ids per feature and min ids "
                             f"per feature; got {sizes}, {most} and {least}")
        for key, size, lo, hi in zip(keys, sizes, least, most):
            if size < 1 or lo < 0 or hi < lo:
                raise ValueError(f"RandomRecDataset: key {key!r} needs hash size >= 1 and 0 <= min ids <= ids, got "
                                 f"hash size {size}, ids {lo}..{hi}")
        if batch_size < 1:
            raise ValueError(f"RandomRecDataset: batch_size must be >= 1, got {batch_size}")
        self.keys, self.batch_size, self.num_dense, self.is_weighted = list(keys), batch_size, num_dense, is_weighted
        self._sizes, self._most, self._least = sizes, most, least
        self._generator: Optional[torch.Generator] = None
        if manual_seed is not None:
            self._generator = torch.Generator()
            self._generator.manual_seed(manual_seed)
        self.num_batches = num_batches
        self.num_generated_batches = num_generated_batches
        self._batches = [self._draw() for _ in range(max(num_generated_batches, 0))]

    def _draw(self) -> Batch:
        g = self._generator
        lengths, values = [], []
        for size, lo, hi in zip(self._sizes, self._least, self._most):
            length = torch.randint(lo, hi + 1, (self.batch_size,), dtype=torch.int32, generator=g)
            lengths.append(length)
            values.append(torch.randint(0, size, (int(length.sum()),), generator=g))
        dense = torch.randn(self.batch_size, self.num_dense, generator=g)
        labels = torch.randint(0, 2, (self.batch_size,), generator=g).float()
        all_values = torch.cat(values)
        weights = torch.rand(all_values.numel(), generator=g) if self.is_weighted else None
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=self.keys, values=all_values, lengths=torch.cat(lengths),
                                                     weights=weights)
        return Batch(dense, sparse, labels)

    def __iter__(self) -> Iterator[Batch]:
        produced = 0
        while self.num_batches is None or produced < self.num_batches:
            yield self._batches[produced % len(self._batches)] if self._batches else self._draw()
            produced += 1
