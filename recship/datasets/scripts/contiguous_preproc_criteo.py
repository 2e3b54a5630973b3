"""Criteo sparse ids -> contiguous ids (TorchRec's ``torchrec.datasets.scripts.contiguous_preproc_criteo``):
``day_<d>_sparse.npy`` of every day in ``--input_dir`` renumbered together (``BinaryCriteoUtils.sparse_to_contiguous``)
into ``--output_dir`` as ``day_<d>_sparse_contig_freq.npy``."""

import argparse
import os
import sys
from typing import List

from recship.datasets.criteo import DAYS, BinaryCriteoUtils


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Criteo sparse -> contiguous preprocessing script.")
    parser.add_argument("--input_dir", type=str, required=True,
                        help="directory of the sparse npy files day_0_sparse.npy ... day_23_sparse.npy")
    parser.add_argument("--output_dir", type=str, required=True, help="directory for the renumbered npy files")
    parser.add_argument("--frequency_threshold", type=int, default=0,
                        help="ids seen fewer times become 1 (0: no threshold)")
    return parser.parse_args(argv)


def main(argv: List[str]) -> int:
    """Renumbers the days' sparse files; returns 0 (FileNotFoundError naming a missing day file)."""
    args = parse_args(argv)
    files = [os.path.join(args.input_dir, f"day_{d}_sparse.npy") for d in range(DAYS)]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of the {DAYS} day files are missing, first {missing[0]}")
    BinaryCriteoUtils.sparse_to_contiguous(files, args.output_dir, frequency_threshold=args.frequency_threshold)
    print(f"{len(files)} files renumbered into {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
