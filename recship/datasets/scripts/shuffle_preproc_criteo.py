"""Shuffle preprocessed Criteo (TorchRec's ``torchrec.datasets.scripts.shuffle_preproc_criteo``): the training days'
rows (days 0-22: dense and labels from ``--input_dir_labels_and_dense``, sparse from ``--input_dir_sparse``) shuffled
together into ``--output_dir_shuffled`` (``BinaryCriteoUtils.shuffle``); day 23 is copied as it is."""

import argparse
import os
import sys
from typing import List, MutableMapping

from recship.datasets.criteo import DAYS, INT_FEATURE_COUNT, BinaryCriteoUtils

COLUMNS = 40  # 13 dense, 26 sparse, 1 label, in that order
INT_COLUMNS = INT_FEATURE_COUNT


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Shuffle preprocessed npy dataset.")
    parser.add_argument("--input_dir_labels_and_dense", type=str, required=True,
                        help="directory of day_<d>_dense.npy and day_<d>_labels.npy")
    parser.add_argument("--input_dir_sparse", type=str, required=True,
                        help="directory of day_<d>_sparse.npy (may differ: the sparse ids are often renumbered apart)")
    parser.add_argument("--output_dir_full_set", type=str, default=None,
                        help="also write the unshuffled training rows here as full.npy")
    parser.add_argument("--output_dir_shuffled", type=str, required=True, help="directory for the shuffled day files")
    parser.add_argument("--random_seed", type=int, default=0, help="seed of the shuffle")
    return parser.parse_args(argv)


def count_rows(rows_per_file: MutableMapping[int, int], path: str, day: int) -> None:
    """Sets ``rows_per_file[day]`` to the rows of ``<path>/day_<day>_labels.npy`` (read from its header)."""
    rows_per_file[day] = BinaryCriteoUtils.get_shape_from_npy(os.path.join(path, f"day_{day}_labels.npy"))[0]


def main(argv: List[str]) -> int:
    """Counts the training days' rows, shuffles them; returns 0."""
    args = parse_args(argv)
    rows_per_file: dict = {}
    for day in range(DAYS - 1):
        count_rows(rows_per_file, args.input_dir_labels_and_dense, day)
    BinaryCriteoUtils.shuffle(args.input_dir_labels_and_dense, args.input_dir_sparse, args.output_dir_shuffled,
                              rows_per_file, args.output_dir_full_set, random_seed=args.random_seed, days=DAYS)
    print(f"{sum(rows_per_file.values())} rows of days 0-{DAYS - 2} shuffled into {args.output_dir_shuffled}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
