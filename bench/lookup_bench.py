"""Inference lookups: recship's modules against their local baselines, in alternating rounds.

    .venv/bin/python bench/lookup_bench.py [--tables 8 --rows 1000000 --dim 128 --batch 512 --pooling 20]
        [--threads 1] [--rounds 30] [--repeats 5] [--fresh-kjt] [--torchrec-python /path/to/python]

FP32: recship's EmbeddingBagCollection (KJT in, KeyedTensor out, ids checked) against
plain nn.EmbeddingBag called table by table on prepared ids/offsets plus the torch.cat
of their outputs (the local baseline; the very same parameters), and TorchRec's
EmbeddingBagCollection on the same parameters when ``--torchrec-python`` names an
interpreter whose torchrec runs on this venv's torch build (its site-packages are
appended to sys.path; TorchRec's own KJT is the input).
FP16, INT8, INT4: QuantEmbeddingBagCollection against fbgemm's kernel called directly on
the same weights with prepared indices/offsets.

Every round times each contender once (``--repeats`` calls, in a shuffled order), so all
see the same machine state; with one thread the clock is CPU time (waiting for a busy core
does not count), else wall time. A ratio is the median over rounds of that round's ratio
(robust to other load on the machine), "best" the fastest round against the fastest
round. The module's overhead is its ratio to the baseline minus 1. A KJT is built once and reused unless
``--fresh-kjt`` (both TorchRec and recship cache per-feature views on a reused KJT).
The last column is torch index_select gathering as many random rows of the same width:
the machine's practical limit for this access pattern.
"""

import argparse
import importlib
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from recship.plots import write_bench_chart
from recship.quantize import QuantConfig, quantize_embedding_bag_collection, row_bytes
from recship.sparse import KeyedJaggedTensor
from recship.trainer import DataType, EmbeddingBagCollection, EmbeddingBagConfig


PLOT = Path(__file__).resolve().parent / "out" / "lookup_bench.png"


def _rounds(fns: Dict[str, Callable[[], object]], rounds: int, repeats: int, clock: Callable[[], float]) -> Dict[str, List[float]]:
    """Seconds per call of each fn, one entry per round; the fns alternate in a shuffled order."""
    for fn in fns.values():
        for _ in range(2):
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    order = list(fns.items())
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name, fn in order:
            start = clock()
            for _ in range(repeats):
                fn()
            times[name].append((clock() - start) / repeats)
    return times


def _ratio(times: Dict[str, List[float]], a: str, b: str) -> float:
    """Median over rounds of time(a) / time(b) in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def _import_torchrec(python: str) -> Any:
    """The torchrec module of ``python``'s environment, imported here: appends the site-packages
    it comes from to sys.path, after checking that that interpreter has this process's torch.

    By name at run time, not with an import statement: recship never depends on torchrec
    (tests/test_package.py rejects any ``import torchrec``); this optional comparison is the
    one place that loads it.
    """
    code = "import os, torch, torchrec; print(torch.__version__); print(os.path.dirname(os.path.dirname(torchrec.__file__)))"
    found = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if found.returncode != 0:
        last = (found.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"--torchrec-python {python}: cannot import torchrec there: {last}")
    version, site = found.stdout.split()[-2:]
    if version != torch.__version__:
        raise SystemExit(f"--torchrec-python {python} has torch {version}, this venv {torch.__version__}: not comparable")
    sys.path.append(site)
    import fbgemm_gpu  # noqa: F401  (torchrec needs fbgemm's ops; this venv's copy loads first)

    return importlib.import_module("torchrec")


def _float_section(args: argparse.Namespace, torchrec: Any, ebc: EmbeddingBagCollection, ids: torch.Tensor, lengths: torch.Tensor, keys: List[str]) -> Dict[str, List[float]]:
    t, b, p = args.tables, args.batch, args.pooling
    kjt = KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths)
    bags = list(ebc.embedding_bags.values())
    per_table_ids = ids.view(t, b * p)
    offsets = torch.arange(0, b * p + 1, p)

    def baseline() -> torch.Tensor:
        return torch.cat([bags[i](per_table_ids[i], offsets) for i in range(t)], dim=1)

    def recship() -> torch.Tensor:
        return ebc(KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths) if args.fresh_kjt else kjt).values()

    fns: Dict[str, Callable[[], object]] = {"nn.EmbeddingBag": baseline, "recship": recship}
    want = baseline()
    assert torch.equal(recship(), want)
    if torchrec is not None:
        tables = [torchrec.EmbeddingBagConfig(name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim, feature_names=[f"f{i}"]) for i in range(t)]
        trec = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        for i in range(t):  # the same parameters: only the code around the kernels differs
            trec.embedding_bags[f"t{i}"].weight = ebc.embedding_bags[f"t{i}"].weight
        trec_kjt = torchrec.KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths)

        def torchrec_ebc() -> torch.Tensor:
            k = torchrec.KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths) if args.fresh_kjt else trec_kjt
            return trec(k).values()

        assert torch.equal(torchrec_ebc(), want)
        fns["torchrec"] = torchrec_ebc
    return _rounds(fns, args.rounds, args.repeats, args.clock)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=8, help="number of tables, one feature each")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=128, help="embedding dim")
    parser.add_argument("--batch", type=int, default=512, help="examples per batch")
    parser.add_argument("--pooling", type=int, default=20, help="ids per example and feature")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=30, help="alternating rounds per data type")
    parser.add_argument("--repeats", type=int, default=5, help="calls per contender and round")
    parser.add_argument("--fresh-kjt", action="store_true", help="build the KJT inside every module call (as a server does)")
    parser.add_argument("--torchrec-python", help="an interpreter with torchrec on the same torch build: adds TorchRec's float EBC")
    parser.add_argument("--types", default="FP32,FP16,INT8,INT4", help="comma-separated data types to run")
    parser.add_argument("--plot", default=str(PLOT), metavar="PNG", help=f"the chart of the results (default bench/out/{PLOT.name}; '' for none)")
    args = parser.parse_args(argv)
    torchrec = _import_torchrec(args.torchrec_python) if args.torchrec_python else None
    torch.set_num_threads(args.threads)
    # one thread: CPU time, which time spent waiting for the core (other load) does not inflate;
    # several: wall time, as CPU time would add the threads up
    args.clock = time.process_time if args.threads == 1 else time.perf_counter
    t, r, d, b, p = args.tables, args.rows, args.dim, args.batch, args.pooling
    print(f"{t} tables x {r} rows x dim {d}, batch {b}, pooling {p}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds x {args.repeats} calls, {'fresh' if args.fresh_kjt else 'reused'} KJT, "
          f"{'CPU' if args.threads == 1 else 'wall'} time")
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=r, embedding_dim=d, feature_names=[f"f{i}"]) for i in range(t)]
    ebc = EmbeddingBagCollection(tables)
    g = torch.Generator().manual_seed(0)
    keys = [f"f{i}" for i in range(t)]
    ids = torch.randint(0, r, (t * b * p,), generator=g)
    lengths = torch.full((t * b,), p)
    kjt = KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths)
    offsets = kjt.offsets().to(torch.int64)
    lookups = t * b * p

    print(f"{'type':5s} {'module Mlookups/s':>18s} {'GB/s':>6s} {'baseline Mlookups/s':>20s} {'GB/s':>6s} "
          f"{'overhead':>9s} {'best':>7s} {'vs TorchRec':>12s} {'index_select GB/s':>18s}")
    labels: List[str] = []
    speed: Dict[str, List[float]] = {"module": [], "baseline": [], "index_select of as many rows": []}
    with torch.no_grad():
        for name in args.types.split(","):
            dtype = DataType[name]
            width = 4 * d if dtype == DataType.FP32 else row_bytes(dtype, d)
            if dtype == DataType.FP32:
                times = _float_section(args, torchrec, ebc, ids, lengths, keys)
                module, baseline = "recship", "nn.EmbeddingBag"
            else:
                qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype=dtype, error_minimizing=False, chunk_rows=262144))
                tbe = qebc.tbes[0]
                assert torch.equal(qebc(kjt).values(), tbe(ids, offsets))

                def quant_module() -> torch.Tensor:
                    return qebc(KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths) if args.fresh_kjt else kjt).values()

                module, baseline = "module", "kernel"
                times = _rounds({module: quant_module, baseline: lambda: tbe(ids, offsets)}, args.rounds, args.repeats, args.clock)
                del qebc, tbe
            rows = torch.ones(t * r, width, dtype=torch.uint8)  # written, so every page is real
            flat = ids + torch.arange(t).repeat_interleave(b * p) * r
            gather = statistics.median(_rounds({"gather": lambda: rows.index_select(0, flat)}, 5, args.repeats, args.clock)["gather"])
            rows = None  # free it before the next type
            gb = lookups * width / 1e9
            module_s, baseline_s = statistics.median(times[module]), statistics.median(times[baseline])
            overhead = _ratio(times, module, baseline) - 1
            best = min(times[module]) / min(times[baseline]) - 1
            trec = f"{_ratio(times, 'torchrec', module):11.3f}x" if "torchrec" in times else f"{'-':>12s}"
            labels.append(f"{dtype.name} ({module} vs {baseline})")
            for key, value in zip(speed, (lookups / module_s, lookups / baseline_s, lookups / gather)):
                speed[key].append(value / 1e6)
            print(f"{dtype.name:5s} {lookups / module_s / 1e6:18.1f} {gb / module_s:6.2f} {lookups / baseline_s / 1e6:20.1f} "
                  f"{gb / baseline_s:6.2f} {overhead:9.1%} {best:7.1%} {trec} {gb / gather:18.2f}")
    print("overhead: median over rounds of module/baseline time - 1; best: fastest round against fastest round; "
          "vs TorchRec: recship's speed as a multiple of TorchRec's (median of TorchRec's time over recship's)")
    if labels:
        write_bench_chart(args.plot, f"lookups: {t} tables x {r} rows x dim {d}, batch {b}, pooling {p}", labels,
                          {"Mlookups/s (median round)": speed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
