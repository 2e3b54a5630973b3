"""TorchRec's ``torchrec.datasets.criteo``: the Criteo layout constants, ``CriteoIterDataPipe`` /
``criteo_terabyte`` / ``criteo_kaggle`` (rows of the Criteo TSV files as {column: value} dicts) and the binary
(npy) pipeline: ``BinaryCriteoUtils`` (TSV to npy, contiguous ids, shuffling, row ranges per rank) and
``InMemoryBinaryCriteoIterDataPipe`` (batches of the npy files, each rank its share). recship's own Criteo reader
for training is ``recship.trainer.data.CriteoTSV`` (what ``recship train --data FILE`` reads).
"""

import logging
import os
import shutil
from typing import Any, Callable, Dict, Iterable, Iterator, List, Literal, Optional, Tuple, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset, IterDataPipe, get_worker_info

from recship.datasets.utils import PATH_MANAGER_KEY, Batch, LoadFiles, ReadLinesFromCSV, safe_cast
from recship.names import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from recship.sparse import KeyedJaggedTensor

logger = logging.getLogger(__name__)

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


class BinaryCriteoUtils:
    """The steps that turn Criteo TSV files into the npy files ``InMemoryBinaryCriteoIterDataPipe`` reads (TorchRec's,
    same outputs): per day, ``day_<d>_dense.npy`` [rows, 13] float32 (log of the shifted counts),
    ``day_<d>_sparse.npy`` [rows, 26] int (hashed ids, or contiguous ones after ``sparse_to_contiguous``) and
    ``day_<d>_labels.npy`` [rows, 1] int32. Files are local paths (``path_manager_key`` is accepted and unused)."""

    @staticmethod
    def tsv_to_npys(in_file: str, out_dense_file: str, out_sparse_file: str, out_labels_file: str,
                    dataset_name: str = "criteo_1tb", path_manager_key: str = PATH_MANAGER_KEY) -> None:
        """One TSV file as three npy files: dense ``log(x - min(x) + 2)`` float32 (empty cells 0, min over the whole
        file), sparse the hex ids as int64, labels int32 [rows, 1] (-1 for the Kaggle test set, which has none:
        ``dataset_name="criteo_kaggle"`` and "test" in the file name)."""
        unlabelled = dataset_name == "criteo_kaggle" and "test" in in_file
        first = 0 if unlabelled else 1  # the column of int_0

        def parse(row: List[str]) -> Tuple[List[int], List[int], int]:
            dense = [int(row[i] or "0") for i in range(first, first + INT_FEATURE_COUNT)]
            sparse = [int(row[i] or "0", 16) for i in range(first + INT_FEATURE_COUNT, first + INT_FEATURE_COUNT + CAT_FEATURE_COUNT)]
            return dense, sparse, -1 if unlabelled else int(row[0] or "0")

        rows = list(CriteoIterDataPipe([in_file], row_mapper=parse))
        dense = np.array([r[0] for r in rows], dtype=np.int32)
        sparse = np.array([r[1] for r in rows], dtype=np.int64)
        labels = np.array([r[2] for r in rows], dtype=np.int32).reshape((-1, 1))
        dense -= dense.min() - 2
        for path, arr in ((out_dense_file, np.log(dense, dtype=np.float32)), (out_sparse_file, sparse),
                          (out_labels_file, labels)):
            with open(path, "wb") as f:
                np.save(f, arr)

    @staticmethod
    def get_shape_from_npy(path: str, path_manager_key: str = PATH_MANAGER_KEY) -> Tuple[int, ...]:
        """The shape of the array in npy file ``path``, read from its header only."""
        with open(path, "rb") as f:
            np.lib.format.read_magic(f)
            shape, _, _ = np.lib.format.read_array_header_1_0(f)
            return shape

    @staticmethod
    def get_file_row_ranges_and_remainder(lengths: List[int], rank: int, world_size: int, start_row: int = 0,
                                          last_row: Optional[int] = None) -> Tuple[Dict[int, Tuple[int, int]], int]:
        """({file index: (first row, last row), inclusive}, rows % world_size): ``rank``'s contiguous share of the
        rows ``start_row``..``last_row`` (default: to the end) of files of ``lengths`` rows, the first
        ``remainder`` ranks taking one row more."""
        total = sum(lengths) - start_row if last_row is None else last_row - start_row + 1
        per_rank = np.full(world_size, total // world_size)
        remainder = total % world_size
        per_rank[:remainder] += 1
        bounds = np.cumsum([0] + list(per_rank))
        first, last = int(bounds[rank]) + start_row, int(bounds[rank + 1]) - 1 + start_row
        out: Dict[int, Tuple[int, int]] = {}
        file_first = 0
        for idx, length in enumerate(lengths):
            file_last = file_first + length - 1
            if first <= file_last and last >= file_first:
                out[idx] = (max(first, file_first) - file_first, min(last, file_last) - file_first)
            file_first = file_last + 1
        return out, remainder

    @staticmethod
    def load_npy_range(fname: str, start_row: int, num_rows: int, path_manager_key: str = PATH_MANAGER_KEY,
                       mmap_mode: bool = False) -> np.ndarray:
        """Rows ``start_row`` .. ``start_row + num_rows`` of the 2-D array in npy file ``fname`` (read without the
        rest; memory-mapped with ``mmap_mode``). ValueError for another rank or a range past the end."""
        with open(fname, "rb") as f:
            np.lib.format.read_magic(f)
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            if len(shape) != 2:
                raise ValueError(f"{fname}: cannot load a row range of an array of {len(shape)} dims (2 expected)")
            total_rows, row_size = shape
            if not 0 <= start_row < total_rows:
                raise ValueError(f"start_row ({start_row}) is out of bounds. It must be between 0 and {total_rows - 1}, inclusive.")
            if start_row + num_rows > total_rows:
                raise ValueError(f"num_rows ({num_rows}) exceeds number of available rows ({total_rows}) for the given "
                                 f"start_row ({start_row}).")
            if mmap_mode:
                data = np.load(fname, mmap_mode="r")[start_row:start_row + num_rows]
            else:
                f.seek(start_row * row_size * dtype.itemsize, os.SEEK_CUR)
                data = np.fromfile(f, dtype=dtype, count=num_rows * row_size)
            return data.reshape((num_rows, row_size))

    @staticmethod
    def sparse_to_contiguous(in_files: List[str], output_dir: str, frequency_threshold: int = FREQUENCY_THRESHOLD,
                             columns: int = CAT_FEATURE_COUNT, path_manager_key: str = PATH_MANAGER_KEY,
                             output_file_suffix: str = "_contig_freq.npy") -> None:
        """Renumbers each column's ids over all ``in_files`` (sparse npy files) to 2, 3, ... in order of first
        appearance (files in order, rows in order), ids seen fewer than ``frequency_threshold`` times becoming 1;
        writes ``<output_dir>/<file name before its first dot><output_file_suffix>``."""
        arrays = {os.path.basename(f).split(".")[0]: np.load(f) for f in in_files}
        rows = [len(a) for a in arrays.values()]
        for col in range(columns):
            ids = np.concatenate([a[:, col] for a in arrays.values()])
            unique, first_seen, inverse, counts = np.unique(ids, return_index=True, return_inverse=True, return_counts=True)
            kept = counts >= frequency_threshold if frequency_threshold > 1 else np.ones(len(unique), dtype=bool)
            codes = np.ones(len(unique), dtype=np.int64)
            order = np.argsort(first_seen[kept], kind="stable")  # kept ids by first appearance
            kept_codes = np.empty(len(order), dtype=np.int64)
            kept_codes[order] = np.arange(2, 2 + len(order))
            codes[kept] = kept_codes
            renumbered = codes[inverse]
            start = 0
            for arr, n in zip(arrays.values(), rows):
                arr[:, col] = renumbered[start:start + n]
                start += n
            logger.info("sparse_to_contiguous: column %d has %d ids, %d kept", col, len(unique), len(order))
        for name, arr in arrays.items():
            with open(os.path.join(output_dir, name + output_file_suffix), "wb") as f:
                np.save(f, arr)

    @staticmethod
    def shuffle(input_dir_labels_and_dense: str, input_dir_sparse: str, output_dir_shuffled: str,
                rows_per_day: Dict[int, int], output_dir_full_set: Optional[str] = None, days: int = DAYS,
                int_columns: int = INT_FEATURE_COUNT, sparse_columns: int = CAT_FEATURE_COUNT,
                path_manager_key: str = PATH_MANAGER_KEY, random_seed: int = 0) -> None:
        """Shuffles the rows of days 0 .. days - 2 together (numpy's legacy shuffle seeded with ``random_seed``,
        TorchRec's order) and writes them back as day files of the same sizes (dense float32, sparse and labels
        int32); the last day, validation and test, is copied as it is. ``output_dir_full_set``: also writes the
        unshuffled rows as one ``full.npy`` [rows, dense + sparse + 1] float32. (TorchRec sizes its buffer by every
        entry of ``rows_per_day``, so a last-day entry adds zero rows that are shuffled into the training days;
        here only days 0 .. days - 2 count, which is TorchRec's output when ``rows_per_day`` leaves the last day out.)"""
        columns = int_columns + sparse_columns + 1
        full = np.zeros((sum(rows_per_day[d] for d in range(days - 1)), columns), dtype=np.float32)
        start = 0
        for d in range(days - 1):
            end = start + rows_per_day[d]
            full[start:end, :int_columns] = np.load(os.path.join(input_dir_labels_and_dense, f"day_{d}_dense.npy"))
            full[start:end, int_columns:columns - 1] = np.load(os.path.join(input_dir_sparse, f"day_{d}_sparse.npy"))
            full[start:end, columns - 1:] = np.load(os.path.join(input_dir_labels_and_dense, f"day_{d}_labels.npy"))
            start = end
        if output_dir_full_set is not None:
            with open(os.path.join(output_dir_full_set, "full.npy"), "wb") as f:
                np.save(f, full)
        np.random.RandomState(random_seed).shuffle(full)  # the stream np.random.seed(random_seed) gives, kept local
        start = 0
        for d in range(days - 1):
            end = start + rows_per_day[d]
            for part, arr in (("dense", full[start:end, :int_columns]),
                              ("sparse", full[start:end, int_columns:columns - 1].astype(np.int32)),
                              ("labels", full[start:end, columns - 1:].astype(np.int32))):
                with open(os.path.join(output_dir_shuffled, f"day_{d}_{part}.npy"), "wb") as f:
                    np.save(f, arr)
            start = end
        for part, input_dir in (("sparse", input_dir_sparse), ("dense", input_dir_labels_and_dense),
                                ("labels", input_dir_labels_and_dense)):
            shutil.copyfile(os.path.join(input_dir, f"day_{days - 1}_{part}.npy"),
                            os.path.join(output_dir_shuffled, f"day_{days - 1}_{part}.npy"))


class InMemoryBinaryCriteoIterDataPipe(IterableDataset):
    """Batches of binary Criteo (the npy files of ``BinaryCriteoUtils``), loaded whole into memory (or memory-mapped
    with ``mmap_mode``); batch i goes to rank i % world_size, so every rank yields the same number of batches.

    Args:
        stage: "train", "val" (the first half, rounded up, of the first file) or "test" (its second half).
        dense_paths / sparse_paths / labels_paths: the day files, in order.
        batch_size: rows per batch.
        rank / world_size: this reader's share.
        drop_last: drop the rows that do not fill a batch on every rank; else the last batches of the ranks split
            them (as evenly as possible).
        shuffle_batches: shuffle each batch's rows.
        shuffle_training_set (stage "train"): shuffle all rows across files before batching (each rank keeps its
            share, read as one rank); ``shuffle_training_set_random_seed`` seeds it and ``shuffle_batches``.
        hashes: 26 table sizes: each feature's ids are taken modulo its size.

    Each batch: dense [B, 13] float32, a KJT of the 26 features with one id per example, labels [B] int32.
    """

    def __init__(self, stage: str, dense_paths: List[str], sparse_paths: List[str], labels_paths: List[str],
                 batch_size: int, rank: int, world_size: int, drop_last: Optional[bool] = False,
                 shuffle_batches: bool = False, shuffle_training_set: bool = False,
                 shuffle_training_set_random_seed: int = 0, mmap_mode: bool = False, hashes: Optional[List[int]] = None,
                 path_manager_key: str = PATH_MANAGER_KEY) -> None:
        if stage not in ("train", "val", "test"):
            raise ValueError(f"stage must be 'train', 'val' or 'test', got {stage!r}")
        if not dense_paths or not len(dense_paths) == len(sparse_paths) == len(labels_paths):
            raise ValueError(f"give as many dense, sparse and labels files (at least one), got {len(dense_paths)}, "
                             f"{len(sparse_paths)} and {len(labels_paths)}")
        if hashes is not None and len(hashes) != CAT_FEATURE_COUNT:
            raise ValueError(f"hashes must have {CAT_FEATURE_COUNT} table sizes, got {len(hashes)}")
        self.stage, self.batch_size, self.rank, self.world_size = stage, batch_size, rank, world_size
        self.dense_paths, self.sparse_paths, self.labels_paths = dense_paths, sparse_paths, labels_paths
        self.drop_last, self.shuffle_batches, self.mmap_mode = drop_last, shuffle_batches, mmap_mode
        self.shuffle_training_set = shuffle_training_set
        self.path_manager_key = path_manager_key
        self._rng = np.random.RandomState(shuffle_training_set_random_seed)  # TorchRec seeds numpy's global one
        self.hashes: Optional[np.ndarray] = None if hashes is None else np.array(hashes).reshape((1, CAT_FEATURE_COUNT))
        if shuffle_training_set and stage == "train":
            self._shuffle_and_load_data_for_rank()
            self.world_size, self.rank = 1, 0
        else:
            mode: Optional[Literal["r"]] = "r" if mmap_mode else None
            self.dense_arrs: List[np.ndarray] = [np.load(f, mmap_mode=mode) for f in dense_paths]
            self.sparse_arrs: List[np.ndarray] = [np.load(f, mmap_mode=mode) for f in sparse_paths]
            self.labels_arrs: List[np.ndarray] = [np.load(f, mmap_mode=mode) for f in labels_paths]
        half = (len(self.dense_arrs[0]) + 1) // 2
        if stage in ("val", "test"):
            rows = slice(None, half) if stage == "val" else slice(half, None)
            for arrs in (self.dense_arrs, self.sparse_arrs, self.labels_arrs):
                arrs[0] = arrs[0][rows, :]
        if not mmap_mode and self.hashes is not None:
            for sparse in self.sparse_arrs:
                sparse %= self.hashes
        self.num_rows_per_file: List[int] = [len(a) for a in self.dense_arrs]
        total_rows = sum(self.num_rows_per_file)
        self.num_full_batches: int = total_rows // batch_size // self.world_size * self.world_size
        self.last_batch_sizes: np.ndarray = np.zeros(self.world_size, dtype=np.int64)
        remainder = total_rows % (self.world_size * batch_size)
        if not drop_last and remainder > 0:
            if remainder < self.world_size:  # too few rows for one each: the last full round is split instead
                self.num_full_batches -= self.world_size
                self.last_batch_sizes += batch_size
            else:
                self.last_batch_sizes += remainder // self.world_size
            self.last_batch_sizes[:remainder % self.world_size] += 1
        self.keys: List[str] = DEFAULT_CAT_NAMES
        self.lengths = torch.ones(CAT_FEATURE_COUNT * batch_size, dtype=torch.int32)
        self.offsets = torch.arange(0, CAT_FEATURE_COUNT * batch_size + 1, dtype=torch.int32)
        self.length_per_key: List[int] = CAT_FEATURE_COUNT * [batch_size]
        self.offset_per_key: List[int] = [batch_size * i for i in range(CAT_FEATURE_COUNT + 1)]
        self.index_per_key: Dict[str, int] = {key: i for i, key in enumerate(self.keys)}

    def _shuffle_and_load_data_for_rank(self) -> None:
        """This rank's share of all rows, permuted across files: rows go to the ranks by their permuted position."""
        dense = [np.load(f, mmap_mode="r") for f in self.dense_paths]
        sparse = [np.load(f, mmap_mode="r") for f in self.sparse_paths]
        labels = [np.load(f, mmap_mode="r") for f in self.labels_paths]
        rows_per_file = [len(a) for a in dense]
        permutation = self._rng.permutation(sum(rows_per_file))
        self.remainder = len(permutation) % self.world_size
        per_rank = np.full(self.world_size, len(permutation) // self.world_size)
        per_rank[:self.remainder] += 1
        ends, starts = np.cumsum(per_rank), np.cumsum([0] + list(per_rank))
        rows = per_rank[self.rank]
        out = [np.empty((rows, arrs[0].shape[1]), arrs[0].dtype) for arrs in (dense, sparse, labels)]
        file_starts = np.cumsum([0] + rows_per_file)
        for i in range(len(dense)):
            mine = np.where(np.digitize(permutation[file_starts[i]:file_starts[i + 1]], ends) == self.rank)[0]
            where = permutation[file_starts[i] + mine] - starts[self.rank]
            for dst, src in zip(out, (dense, sparse, labels)):
                dst[where] = src[i][mine]
        self.dense_arrs, self.sparse_arrs, self.labels_arrs = [out[0]], [out[1]], [out[2]]

    def _np_arrays_to_batch(self, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> Batch:
        if self.shuffle_batches:
            order = self._rng.permutation(len(dense))
            dense, sparse, labels = dense[order], sparse[order], labels[order]
        b = len(dense)
        full = b == self.batch_size
        # The last round may hand a rank more rows than batch_size (too few rows left for one each: it is split).
        lengths, offsets = self.lengths, self.offsets
        if b > self.batch_size:
            lengths = torch.ones(CAT_FEATURE_COUNT * b, dtype=torch.int32)
            offsets = torch.arange(0, CAT_FEATURE_COUNT * b + 1, dtype=torch.int32)
        kjt = KeyedJaggedTensor(
            keys=self.keys, values=torch.from_numpy(sparse.transpose(1, 0).reshape(-1)),
            lengths=lengths[:CAT_FEATURE_COUNT * b], offsets=offsets[:CAT_FEATURE_COUNT * b + 1], stride=b,
            length_per_key=self.length_per_key if full else CAT_FEATURE_COUNT * [b],
            offset_per_key=self.offset_per_key if full else [b * i for i in range(CAT_FEATURE_COUNT + 1)],
            index_per_key=self.index_per_key)
        return Batch(dense_features=torch.from_numpy(dense), sparse_features=kjt, labels=torch.from_numpy(labels.reshape(-1)))

    def __iter__(self) -> Iterator[Batch]:
        buffer: Optional[List[np.ndarray]] = None
        file_idx = row_idx = batch_idx = buffered = 0
        batch_rows = self.batch_size if self.num_full_batches > 0 else int(self.last_batch_sizes[0])
        batches = self.num_full_batches + (self.last_batch_sizes[0] > 0) * self.world_size
        while batch_idx < batches:
            if buffered == batch_rows or file_idx == len(self.dense_arrs):
                if batch_idx % self.world_size == self.rank:
                    if buffer is None:
                        raise RuntimeError("InMemoryBinaryCriteoIterDataPipe: a batch with no rows")  # internal invariant
                    yield self._np_arrays_to_batch(*buffer)
                    buffer = None
                buffered = 0
                batch_idx += 1
                if 0 <= batch_idx - self.num_full_batches < self.world_size and self.last_batch_sizes[0] > 0:
                    batch_rows = int(self.last_batch_sizes[batch_idx - self.num_full_batches])
            else:
                take = min(batch_rows - buffered, self.num_rows_per_file[file_idx] - row_idx)
                buffered += take
                if batch_idx % self.world_size == self.rank:
                    rows = slice(row_idx, row_idx + take)
                    sparse = self.sparse_arrs[file_idx][rows, :]
                    if self.mmap_mode and self.hashes is not None:
                        sparse = sparse % self.hashes
                    parts = [self.dense_arrs[file_idx][rows, :], sparse, self.labels_arrs[file_idx][rows, :]]
                    buffer = parts if buffer is None else [np.concatenate((a, b)) for a, b in zip(buffer, parts)]
                row_idx += take
                if row_idx >= self.num_rows_per_file[file_idx]:
                    file_idx, row_idx = file_idx + 1, 0

    def __len__(self) -> int:
        return self.num_full_batches // self.world_size + int(self.last_batch_sizes[0] > 0)


__all__ = ["Batch", "BinaryCriteoUtils", "InMemoryBinaryCriteoIterDataPipe", "CAT_FEATURE_COUNT", "COLUMN_TYPE_CASTERS", "CriteoIterDataPipe", "DAYS", "DEFAULT_CAT_NAMES",
           "DEFAULT_COLUMN_NAMES", "DEFAULT_INT_NAMES", "DEFAULT_LABEL_NAME", "FREQUENCY_THRESHOLD", "INT_FEATURE_COUNT",
           "KeyedJaggedTensor", "LoadFiles", "PATH_MANAGER_KEY", "ReadLinesFromCSV", "TOTAL_TRAINING_SAMPLES",
           "criteo_kaggle", "criteo_terabyte", "safe_cast"]
