import logging
import math

import pytest
import torch

from recship.trainer.data import CriteoTSV, SyntheticConfig, SyntheticCriteo, prefetch
from reference import kjt_as_lists

ROWS = [50 + i for i in range(26)]


def _line(g, label=None, empty_every=0):
    label = int(torch.randint(0, 2, (1,), generator=g)) if label is None else label
    dense = [str(int(torch.randint(-2, 1000, (1,), generator=g))) for _ in range(13)]
    cats = ["%08x" % int(torch.randint(0, 2**31, (1,), generator=g)) for _ in range(26)]
    if empty_every:
        dense[3] = ""
        cats[5] = ""
    return [str(label)] + dense + cats


def _expected(fields):
    """Independent parse of one good line: (label, dense, {feature: ids})."""
    dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:14]]
    ids = {f"cat_{i}": ([int(x, 16) % ROWS[i]] if x else []) for i, x in enumerate(fields[14:])}
    return int(fields[0]), dense, ids


def test_criteo_reader_parses_and_skips_malformed_lines(tmp_path, caplog):
    g = torch.Generator().manual_seed(0)
    good = [_line(g, empty_every=(i % 3 == 0)) for i in range(7)]
    lines = ["\t".join(f) for f in good]
    lines.insert(2, "1\t2\t3")  # too few fields (line 3)
    bad_hex = _line(g)
    bad_hex[20] = "zz-not-hex"
    lines.insert(5, "\t".join(bad_hex))  # line 6
    bad_label = _line(g, label=2)
    lines.append("\t".join(bad_label))  # line 10
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join(lines) + "\n")
    reader = CriteoTSV(path, ROWS, batch_size=3)
    with caplog.at_level(logging.WARNING):
        batches = list(reader)
    assert reader.malformed == 3
    warned = " ".join(r.getMessage() for r in caplog.records)
    for number in (3, 6, 10):
        assert f"{path}:{number}:" in warned
    assert [len(b) for b in batches] == [3, 3, 1]
    expect = [_expected(f) for f in good]
    labels = torch.cat([b.labels for b in batches])
    assert labels.tolist() == [e[0] for e in expect]
    torch.testing.assert_close(torch.cat([b.dense for b in batches]), torch.tensor([e[1] for e in expect]))
    got = {}
    for b in batches:
        for k, rows in kjt_as_lists(b.sparse).items():
            got.setdefault(k, []).extend(rows)
    assert got == {k: [e[2][k] for e in expect] for k in expect[0][2]}


def test_criteo_reader_splits_lines_across_ranks(tmp_path):
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "d.tsv"
    path.write_text("\n".join("\t".join(_line(g)) for _ in range(5)) + "\n")
    all_labels = torch.cat([b.labels for b in CriteoTSV(path, ROWS, batch_size=10)])
    parts = [torch.cat([b.labels for b in CriteoTSV(path, ROWS, 10, rank=r, world_size=2)]) for r in range(2)]
    assert parts[0].tolist() == all_labels[0::2].tolist() and parts[1].tolist() == all_labels[1::2].tolist()


def test_criteo_reader_errors():
    with pytest.raises(FileNotFoundError, match="not found"):
        CriteoTSV("/nonexistent.tsv", ROWS)
    with pytest.raises(ValueError, match="26 categorical"):
        CriteoTSV("/nonexistent.tsv", ROWS[:3])


def test_synthetic_is_deterministic_and_in_range():
    cfg = SyntheticConfig(num_embeddings_per_feature=[10, 1000, 7], batch_size=64, seed=3)
    a, b = SyntheticCriteo(cfg), SyntheticCriteo(cfg)
    x, y = a.batch(5, rank=1), b.batch(5, rank=1)
    assert torch.equal(x.sparse.values(), y.sparse.values()) and torch.equal(x.labels, y.labels)
    assert not torch.equal(a.batch(6, 1).labels, x.labels) or not torch.equal(a.batch(6, 1).dense, x.dense)
    for rows, (name, jt) in zip(cfg.num_embeddings_per_feature, x.sparse.to_dict().items()):
        assert int(jt.values().min()) >= 0 and int(jt.values().max()) < rows
    assert x.dense.shape == (64, 13) and set(x.labels.unique().tolist()) <= {0.0, 1.0}


def test_synthetic_ids_are_skewed():
    cfg = SyntheticConfig(num_embeddings_per_feature=[1000], batch_size=2048, seed=0)
    ids = SyntheticCriteo(cfg).batch(0).sparse.values()
    counts = torch.bincount(ids, minlength=1000).sort(descending=True).values
    assert counts[:10].sum() > 0.2 * ids.numel()  # Zipf: a few ids dominate


def test_prefetch_keeps_order_and_raises_producer_errors():
    assert list(prefetch(iter(range(10)), depth=2)) == list(range(10))

    def broken():
        yield 1
        raise ValueError("bad data")

    with pytest.raises(ValueError, match="bad data"):
        list(prefetch(broken()))
