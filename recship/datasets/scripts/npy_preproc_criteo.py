"""Criteo TSV -> npy (TorchRec's ``torchrec.datasets.scripts.npy_preproc_criteo``): each day file ``day_<d>`` of the
1TB logs (or Kaggle's ``train.txt`` / ``test.txt``) in ``--input_dir`` becomes ``<name>_dense.npy``,
``<name>_sparse.npy`` and ``<name>_labels.npy`` in ``--output_dir``; missing inputs are skipped."""

import argparse
import os
import sys
from typing import List

from recship.datasets.criteo import DAYS, BinaryCriteoUtils


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Criteo tsv -> npy preprocessing script.")
    parser.add_argument("--input_dir", type=str, required=True,
                        help="directory of the Criteo TSV files: day_0 ... day_23 (criteo_1tb) or train.txt and test.txt "
                             "(criteo_kaggle)")
    parser.add_argument("--output_dir", type=str, required=True, help="directory for the npy files")
    parser.add_argument("--dataset_name", type=str, choices=["criteo_1tb", "criteo_kaggle"], default="criteo_1tb",
                        help="which Criteo dataset the files are")
    return parser.parse_args(argv)


def main(argv: List[str]) -> int:
    """Converts every input file present; returns 0 (ValueError if none is)."""
    args = parse_args(argv)
    if args.dataset_name == "criteo_1tb":
        pairs = [(f"day_{d}", f"day_{d}") for d in range(DAYS)]
    else:
        pairs = [("train.txt", "train"), ("test.txt", "test")]
    done = 0
    for name, out in pairs:
        path = os.path.join(args.input_dir, name)
        if not os.path.exists(path):
            continue
        dense, sparse, labels = (os.path.join(args.output_dir, f"{out}_{part}.npy") for part in ("dense", "sparse", "labels"))
        BinaryCriteoUtils.tsv_to_npys(path, dense, sparse, labels, args.dataset_name)
        print(f"{path} -> {dense}, {sparse}, {labels}")
        done += 1
    if not done:
        raise ValueError(f"{args.input_dir} holds none of {[name for name, _ in pairs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
