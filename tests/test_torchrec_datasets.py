"""``torchrec.datasets`` as TorchRec's examples import it, through docs/torchrec.md's import map (tests/tutorials/notebook.py
rewrites the imports as it does for the tutorials): the Criteo constants against the Criteo layout, Batch, and
RandomRecDataset against what it promises (shapes, id ranges, repetition, the seed)."""

from pathlib import Path

import torch

from tutorials.notebook import import_map, rewrite_imports

# TorchRec user code, kept out of .py files (torchrec is not a dependency: no .py file imports it)
USER_CODE = (Path(__file__).parent / "snippets" / "torchrec_datasets.txt").read_text()


def test_torchrec_datasets_through_the_import_map():
    code = rewrite_imports(USER_CODE, import_map())
    assert "torchrec" not in code.replace("RandomRecDataset", "")
    scope: dict = {}
    exec(compile(code, "user_code", "exec"), scope)
    assert (scope["INT_FEATURE_COUNT"], scope["CAT_FEATURE_COUNT"]) == (13, 26)
    assert scope["DEFAULT_COLUMN_NAMES"] == ["label"] + [f"int_{i}" for i in range(13)] + [f"cat_{i}" for i in range(26)]
    batches, again = scope["batches"], scope["again"]
    assert len(batches) == 5 and all(isinstance(b, scope["Batch"]) for b in batches)
    for b in batches:
        kjt = b.sparse_features
        assert b.dense_features.shape == (8, 13) and b.labels.shape == (8,) and set(b.labels.tolist()) <= {0.0, 1.0}
        assert kjt.keys() == ["cat_0", "cat_1", "cat_2"] and kjt.stride() == 8
        for key, rows, ids in zip(kjt.keys(), [10, 20, 30], [1, 2, 3]):
            jt = kjt[key]
            assert 0 <= int(jt.lengths().min()) and int(jt.lengths().max()) <= ids  # TorchRec's: 0 to ids_per_features
            assert 0 <= int(jt.values().min()) and int(jt.values().max()) < rows
    # two batches drawn, then repeated; the same seed draws the same batches
    assert batches[2] is batches[0] and batches[3] is batches[1] and not torch.equal(batches[0].dense_features, batches[1].dense_features)
    assert all(torch.equal(a.sparse_features.values(), b.sparse_features.values()) and torch.equal(a.labels, b.labels)
               for a, b in zip(batches, again))
    moved = batches[0].to(torch.device("cpu"))
    assert torch.equal(moved.dense_features, batches[0].dense_features)


# --- recship.datasets as a library: TorchRec's datapipes and loaders on tiny local files -----------------------

import random  # noqa: E402

import pytest  # noqa: E402
from torch.utils.data import IterDataPipe  # noqa: E402

from recship import datasets as D  # noqa: E402


class _Range(IterDataPipe):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        yield from range(self.n)


def _movielens_folder(tmp_path):
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,10,4.5,100\n2,20,3.0,200\n1,20,,300\n")
    (tmp_path / "movies.csv").write_text('movieId,title,genres\n10,"Heat, The (1995)",Action|Crime\n20,Up (2009),Animation\n')
    return str(tmp_path)


def test_movielens_reads_ratings_and_joins_movies(tmp_path):
    root = _movielens_folder(tmp_path)
    for loader in (D.movielens_20m, D.movielens_25m):
        assert list(loader(root)) == [
            {"userId": 1, "movieId": 10, "rating": 4.5, "timestamp": 100},
            {"userId": 2, "movieId": 20, "rating": 3.0, "timestamp": 200},
            {"userId": 1, "movieId": 20, "rating": 0.0, "timestamp": 300}]  # an empty cell: safe_cast's default
    joined = list(D.movielens_20m(root, include_movies_data=True))
    assert joined[0]["title"] == "Heat, The (1995)" and joined[2]["genres"] == "Animation"
    assert list(D.movielens_20m(root, row_mapper=None))[0] == ["1", "10", "4.5", "100"]
    with pytest.raises(FileNotFoundError, match="no such MovieLens folder"):
        D.movielens_20m(str(tmp_path / "nope"))


def test_criteo_rows_map_from_the_last_column(tmp_path):
    g = random.Random(0)
    lines = [[str(g.randint(0, 1))] + [str(g.randint(0, 50)) if g.random() > 0.2 else "" for _ in range(13)]
             + [format(g.getrandbits(32), "08x") if g.random() > 0.2 else "" for _ in range(26)] for _ in range(4)]
    (tmp_path / "train.txt").write_text("".join("\t".join(line) + "\n" for line in lines))
    (tmp_path / "test.txt").write_text("".join("\t".join(line[1:]) + "\n" for line in lines))
    rows = list(D.criteo_kaggle(str(tmp_path / "train.txt")))
    for row, line in zip(rows, lines):
        assert list(row) == D.DEFAULT_COLUMN_NAMES[::-1]
        assert row["label"] == int(line[0]) and row["cat_25"] == line[-1]
        assert [row[f"int_{i}"] for i in range(13)] == [int(v) if v else 0 for v in line[1:14]]
    test_rows = list(D.criteo_terabyte([str(tmp_path / "test.txt")]))
    assert all("label" not in r and r == {k: v for k, v in full.items() if k != "label"} for r, full in zip(test_rows, rows))


def test_splits_are_disjoint_cover_and_repeat():
    train, val = D.idx_split_train_val(_Range(250), 0.7)
    assert list(train) == [i for i in range(250) if i % 100 < 70] and list(val) == [i for i in range(250) if i % 100 >= 70]
    train, val = D.rand_split_train_val(_Range(200), 0.6, random_seed=3)
    draws = random.Random(3)
    expected = [i for i in range(200) if draws.random() < 0.6]
    assert list(train) == expected == list(train)  # the same on every pass
    assert sorted(list(train) + list(val)) == list(range(200))
    with pytest.raises(ValueError, match=r"train_perc must be in range \(0.0, 1.0\), got 1.0"):
        D.idx_split_train_val(_Range(3), 1.0)
    assert D.train_filter(lambda i: i * 7, 0.5, 1, 1) is False and D.val_filter(lambda i: i * 7, 0.5, 1, 1) is True


def test_small_datapipes(tmp_path):
    (tmp_path / "a.csv").write_text("x;y\n1;2\n3;4\n")
    rows = D.ReadLinesFromCSV(D.LoadFiles([str(tmp_path / "a.csv")], mode="t"), skip_first_line=True, delimiter=";")
    assert list(rows) == [["1", "2"], ["3", "4"]]
    assert list(_Range(10).limit(3)) == [0, 1, 2] == list(D.Limit(_Range(10), 3))
    assert list(D.ParallelReadConcat(_Range(2), _Range(3))) == [0, 1, 0, 1, 2]
    assert D.safe_cast("7", int, 0) == 7 and D.safe_cast("", int, -1) == -1
    with pytest.raises(ValueError, match="Invalid mode 'w'"):
        D.LoadFiles([], mode="w")
    with pytest.raises(ValueError, match="local paths only"):
        list(D.LoadFiles(["s3://bucket/x"]))
    assert len(D.LoadFiles([], length=4)) == 4
    assert isinstance(D.Batch(torch.zeros(1, 1), None, torch.zeros(1)), D.Pipelineable)


def test_random_batches_follow_the_documented_draws():
    ds = D.RandomRecDataset(keys=["a", "b"], batch_size=5, hash_sizes=[10, 20], ids_per_features=[3, 4],
                            min_ids_per_features=[1, 0], num_dense=3, manual_seed=11, num_batches=3, num_generated_batches=2)
    g = torch.Generator().manual_seed(11)
    expected = []
    for _ in range(2):
        lengths, values = [], []
        for size, lo, hi in [(10, 1, 3), (20, 0, 4)]:
            length = torch.randint(lo, hi + 1, (5,), dtype=torch.int32, generator=g)
            lengths.append(length)
            values.append(torch.randint(0, size, (int(length.sum()),), generator=g))
        expected.append((torch.cat(lengths), torch.cat(values), torch.randn(5, 3, generator=g),
                         torch.randint(0, 2, (5,), generator=g).float()))
    got = list(ds)
    assert len(got) == 3 and got[2] is got[0]
    for b, (lengths, values, dense, labels) in zip(got, expected):
        assert torch.equal(b.sparse_features.lengths(), lengths) and torch.equal(b.sparse_features.values(), values)
        assert torch.equal(b.dense_features, dense) and torch.equal(b.labels, labels)
    fixed = next(iter(D.RandomRecDataset(keys=["a"], batch_size=4, ids_per_feature=2, manual_seed=0, num_batches=1)))
    assert fixed.sparse_features.lengths().tolist() == [2, 2, 2, 2]  # min defaults to ids_per_feature when given
    with pytest.raises(ValueError, match="key 'a' needs hash size >= 1"):
        D.RandomRecDataset(keys=["a"], batch_size=2, ids_per_feature=1, min_ids_per_feature=3)


def _criteo_days(tmp_path, days=3, seed=0):
    """Tiny Criteo TSV day files, converted to npy; returns the rows as parsed by hand."""
    g = random.Random(seed)
    parsed = []
    for d in range(days):
        lines = [[str(g.randint(0, 1))] + [str(g.randint(0, 50)) if g.random() > 0.2 else "" for _ in range(13)]
                 + [format(g.choice([1, 2, 0xABC, g.getrandbits(20)]), "x") if g.random() > 0.2 else "" for _ in range(26)]
                 for _ in range(7 + d)]
        (tmp_path / f"day_{d}.tsv").write_text("".join("\t".join(line) + "\n" for line in lines))
        D.BinaryCriteoUtils.tsv_to_npys(*(str(tmp_path / f"day_{d}{suffix}") for suffix in
                                          (".tsv", "_dense.npy", "_sparse.npy", "_labels.npy")))
        parsed.append(lines)
    return parsed


def test_binary_criteo_npys(tmp_path):
    import numpy as np

    lines = _criteo_days(tmp_path)[1]
    counts = np.array([[int(v or "0") for v in line[1:14]] for line in lines])
    dense = np.load(tmp_path / "day_1_dense.npy")
    np.testing.assert_array_equal(dense, np.log(counts - counts.min() + 2, dtype=np.float32))
    np.testing.assert_array_equal(np.load(tmp_path / "day_1_sparse.npy"), [[int(v or "0", 16) for v in line[14:]] for line in lines])
    assert np.load(tmp_path / "day_1_labels.npy").ravel().tolist() == [int(line[0]) for line in lines]
    U = D.BinaryCriteoUtils
    assert U.get_shape_from_npy(str(tmp_path / "day_2_sparse.npy")) == (9, 26)
    full = np.load(tmp_path / "day_2_sparse.npy")
    for mmap in (False, True):
        np.testing.assert_array_equal(U.load_npy_range(str(tmp_path / "day_2_sparse.npy"), 3, 4, mmap_mode=mmap), full[3:7])
    with pytest.raises(ValueError, match="exceeds number of available rows"):
        U.load_npy_range(str(tmp_path / "day_2_sparse.npy"), 5, 5)
    # rows 2..23 (22) over 4 ranks: 6, 6, 5, 5 rows, the files holding 7, 8 and 9
    shares = [U.get_file_row_ranges_and_remainder([7, 8, 9], r, 4, start_row=2) for r in range(4)]
    assert shares[0] == ({0: (2, 6), 1: (0, 0)}, 2) and shares[3] == ({2: (4, 8)}, 2)


def test_sparse_to_contiguous_and_shuffle(tmp_path):
    import numpy as np

    _criteo_days(tmp_path)
    U = D.BinaryCriteoUtils
    files = [str(tmp_path / f"day_{d}_sparse.npy") for d in range(3)]
    (tmp_path / "contig").mkdir()
    U.sparse_to_contiguous(files, str(tmp_path / "contig"), frequency_threshold=2)
    before = np.concatenate([np.load(f) for f in files])
    after = np.concatenate([np.load(tmp_path / "contig" / f"day_{d}_sparse_contig_freq.npy") for d in range(3)])
    for col in range(26):  # by hand: first appearance order, rare ids 1
        seen, counts, expected = {}, {}, []
        for x in before[:, col].tolist():
            counts[x] = counts.get(x, 0) + 1
        for x in before[:, col].tolist():
            if counts[x] < 2:
                expected.append(1)
            else:
                expected.append(seen.setdefault(x, 2 + len(seen)))
        assert after[:, col].tolist() == expected
    (tmp_path / "shuf").mkdir()
    U.shuffle(str(tmp_path), str(tmp_path), str(tmp_path / "shuf"), {0: 7, 1: 8}, days=3, random_seed=5)
    rows = lambda d, where: np.concatenate([np.load(where / f"day_{d}_{p}.npy").astype(np.float32) for p in ("dense", "sparse", "labels")], 1)  # noqa: E731
    original = np.concatenate([rows(0, tmp_path), rows(1, tmp_path)])
    shuffled = np.concatenate([rows(0, tmp_path / "shuf"), rows(1, tmp_path / "shuf")])
    expected = original.copy()
    np.random.RandomState(5).shuffle(expected)
    np.testing.assert_array_equal(shuffled, expected)
    np.testing.assert_array_equal(rows(2, tmp_path / "shuf"), rows(2, tmp_path))


# (5, 1): 24 rows leave 4 for the last round of 5 ranks, too few for one each: that round is split, so ranks get
# batches of 2 rows (more than batch_size), as TorchRec's
@pytest.mark.parametrize("world_size,batch_size,drop_last",
                         [(2, 4, False), (3, 4, True), (3, 11, False), (1, 24, False), (5, 1, False)])
def test_in_memory_binary_criteo_batches_cover_the_rows_once(tmp_path, world_size, batch_size, drop_last):
    import numpy as np

    _criteo_days(tmp_path)
    paths = {p: [str(tmp_path / f"day_{d}_{p}.npy") for d in range(3)] for p in ("dense", "sparse", "labels")}
    dense = np.concatenate([np.load(f) for f in paths["dense"]])
    sparse = np.concatenate([np.load(f) for f in paths["sparse"]]) % 7
    seen = []
    for rank in range(world_size):
        pipe = D.InMemoryBinaryCriteoIterDataPipe("train", paths["dense"], paths["sparse"], paths["labels"], batch_size,
                                                  rank, world_size, drop_last=drop_last, hashes=[7] * 26)
        batches = list(pipe)
        assert len(batches) == len(pipe)
        for b in batches:
            kjt = b.sparse_features
            assert kjt.keys() == D.DEFAULT_CAT_NAMES and kjt.lengths().tolist() == [1] * (26 * kjt.stride())
            for row, values in zip(b.dense_features.numpy(), kjt.values().view(26, -1).T.numpy()):
                i = int(np.where((dense == row).all(1))[0][0])
                np.testing.assert_array_equal(values, sparse[i])
                seen.append(i)
    kept = 24 - 24 % (world_size * batch_size) if drop_last else 24
    assert sorted(seen) == list(range(kept))


def test_preprocessing_scripts_chain(tmp_path):
    import numpy as np

    from recship.datasets.scripts import contiguous_preproc_criteo, npy_preproc_criteo, shuffle_preproc_criteo

    g = random.Random(1)
    raw, npy, contig, shuffled = (tmp_path / n for n in ("raw", "npy", "contig", "shuffled"))
    for d in (raw, npy, contig, shuffled):
        d.mkdir()
    for day in range(24):
        (raw / f"day_{day}").write_text("".join(
            "\t".join([str(g.randint(0, 1))] + [str(g.randint(0, 9)) for _ in range(13)] + [format(g.randint(1, 5), "x") for _ in range(26)]) + "\n"
            for _ in range(2)))
    assert npy_preproc_criteo.main(["--input_dir", str(raw), "--output_dir", str(npy)]) == 0
    assert contiguous_preproc_criteo.main(["--input_dir", str(npy), "--output_dir", str(contig), "--frequency_threshold", "3"]) == 0
    for day in range(24):  # the shuffle reads day_<d>_sparse.npy
        (contig / f"day_{day}_sparse_contig_freq.npy").rename(contig / f"day_{day}_sparse.npy")
    assert shuffle_preproc_criteo.main(["--input_dir_labels_and_dense", str(npy), "--input_dir_sparse", str(contig),
                                        "--output_dir_shuffled", str(shuffled), "--random_seed", "2"]) == 0
    def rows(where, sparse_dir, days):
        return np.concatenate([np.concatenate([np.load(where / f"day_{d}_dense.npy"), np.load(sparse_dir / f"day_{d}_sparse.npy"),
                                               np.load(where / f"day_{d}_labels.npy")], 1).astype(np.float32) for d in days])
    expected = rows(npy, contig, range(23))
    np.random.RandomState(2).shuffle(expected)
    np.testing.assert_array_equal(rows(shuffled, shuffled, range(23)), expected)
    assert int(np.load(contig / "day_0_sparse.npy").min()) >= 1
    with pytest.raises(ValueError, match="holds none of"):
        npy_preproc_criteo.main(["--input_dir", str(tmp_path / "contig"), "--output_dir", str(npy), "--dataset_name", "criteo_kaggle"])


def test_random_dataset_len_is_num_batches():
    """As TorchRec's: len() is num_batches, and iterating it twice (itertools.chain) gives that many twice."""
    import itertools

    ds = D.RandomRecDataset(keys=["a", "b"], batch_size=4, hash_size=10, num_batches=3, num_generated_batches=-1,
                            manual_seed=0)
    assert len(ds) == 3
    assert sum(1 for _ in itertools.chain(ds, ds)) == 6
    with pytest.raises(TypeError, match="endless"):
        len(D.RandomRecDataset(keys=["a"], batch_size=2, hash_size=10))
