"""TorchRec's ``torchrec.datasets.utils``: ``Batch``, the datapipes (``LoadFiles``, ``ReadLinesFromCSV``, ``Limit``,
``ParallelReadConcat``), the train/validation splits (``idx_split_train_val``, ``rand_split_train_val``,
``train_filter``, ``val_filter``) and ``safe_cast``. The datapipes are torch's ``IterDataPipe`` (``.map``,
``.limit`` chain as in TorchRec). Files are local paths opened with ``open`` (TorchRec opens them through iopath;
``path_manager_key`` is accepted and unused).
"""

import csv
import math
import random
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, List, Sequence, Tuple, TypeVar, cast

import torch
from torch.utils.data import IterDataPipe, functional_datapipe, get_worker_info

from recship.sparse import KeyedJaggedTensor, Pipelineable

if TYPE_CHECKING:
    from io import IOBase

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
            reader = csv.reader(cast(Iterable[str], data), **self.kw)
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


__all__ = ["Batch", "KeyedJaggedTensor", "Limit", "LoadFiles", "PATH_MANAGER_KEY", "ParallelReadConcat", "Pipelineable",
           "ReadLinesFromCSV", "idx_split_train_val", "rand_split_train_val", "safe_cast", "train_filter", "val_filter"]
