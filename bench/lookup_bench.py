"""Inference lookups: quantized modules vs the raw fbgemm kernel vs a plain row gather.

    .venv/bin/python bench/lookup_bench.py [--tables 8 --rows 1000000 --dim 128 --batch 512 --pooling 20]

For FP32 (the float EmbeddingBagCollection), FP16, INT8 and INT4 it prints lookups/s and
bytes/s of row data read, for (a) the recship module called with a KJT (id validation
included) and (b) fbgemm's kernel called directly on the same weights with prepared
indices/offsets; the module's overhead is (a)/(b) - 1. The last column is torch
index_select gathering the same number of random rows of the same width: the machine's
practical limit for this access pattern.
"""

import argparse
import time

import torch

from recship.quantize import QuantConfig, quantize_embedding_bag_collection, row_bytes
from recship.sparse import KeyedJaggedTensor
from recship.trainer import DataType, EmbeddingBagCollection, EmbeddingBagConfig


def _time(fn, repeats: int, rounds: int = 7) -> float:
    """Seconds per call: the best of ``rounds`` means over ``repeats`` calls (this machine is noisy)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    t, r, d, b, p = args.tables, args.rows, args.dim, args.batch, args.pooling
    print(f"{t} tables x {r} rows x dim {d}, batch {b}, pooling {p}, {torch.get_num_threads()} threads")
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=r, embedding_dim=d, feature_names=[f"f{i}"]) for i in range(t)]
    ebc = EmbeddingBagCollection(tables)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, r, (t * b * p,), generator=g)
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(t)], values=ids, lengths=torch.full((t * b,), p))
    offsets = kjt.offsets().to(torch.int64)
    lookups = t * b * p

    print(f"{'type':5s} {'module Mlookups/s':>18s} {'GB/s':>6s} {'raw kernel Mlookups/s':>22s} {'GB/s':>6s} "
          f"{'overhead':>9s} {'index_select GB/s':>18s}")
    with torch.no_grad():
        for dtype in (DataType.FP32, DataType.FP16, DataType.INT8, DataType.INT4):
            width = 4 * d if dtype == DataType.FP32 else row_bytes(dtype, d)
            if dtype == DataType.FP32:
                module_s = _time(lambda: ebc(kjt), args.repeats)
                raw_s = None
            else:
                qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(data_type=dtype, error_minimizing=False, chunk_rows=262144))
                tbe = qebc.tbes[0]
                # alternate the two so that both see the same machine state
                module_s, raw_s = float("inf"), float("inf")
                for _ in range(5):
                    module_s = min(module_s, _time(lambda: qebc(kjt), args.repeats, rounds=1))
                    raw_s = min(raw_s, _time(lambda: tbe(ids, offsets), args.repeats, rounds=1))
                del qebc, tbe
            rows = torch.ones(t * r, width, dtype=torch.uint8)  # written, so every page is real
            flat = ids + torch.arange(t).repeat_interleave(b * p) * r
            gather_s = _time(lambda: rows.index_select(0, flat), args.repeats)
            rows = None  # free it before the next type
            gb = lookups * width / 1e9
            raw = f"{lookups / raw_s / 1e6:22.1f} {gb / raw_s:6.2f} {module_s / raw_s - 1:9.1%}" if raw_s else f"{'-':>22s} {'-':>6s} {'-':>9s}"
            print(f"{dtype.name:5s} {lookups / module_s / 1e6:18.1f} {gb / module_s:6.2f} {raw} {gb / gather_s:18.2f}")


if __name__ == "__main__":
    main()
