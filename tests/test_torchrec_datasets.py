"""``torchrec.datasets`` as TorchRec's examples import it, through the README's import map (tests/tutorials/notebook.py
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
            assert torch.equal(jt.lengths(), torch.full((8,), ids, dtype=jt.lengths().dtype))
            assert 0 <= int(jt.values().min()) and int(jt.values().max()) < rows
    # two batches drawn, then repeated; the same seed draws the same batches
    assert batches[2] is batches[0] and batches[3] is batches[1] and not torch.equal(batches[0].dense_features, batches[1].dense_features)
    assert all(torch.equal(a.sparse_features.values(), b.sparse_features.values()) and torch.equal(a.labels, b.labels)
               for a, b in zip(batches, again))
    moved = batches[0].to(torch.device("cpu"))
    assert torch.equal(moved.dense_features, batches[0].dense_features)
