"""The same request, the same answer: an artifact's output for a request does not depend on the requests it was
batched with, on where it sat in the batch, or on the intra-op thread count (export/blocks.py).

References: ``run_in_blocks`` against outputs computed exactly in float64 from the flat inputs; the artifacts'
answers for a request alone against its answer inside batches built here (plain concatenation of requests, not
the server's code), bitwise, for both model files (model.pt, model.pt2) of a DLRM with wide dense layers, the
two-tower (an EmbeddingCollection, a sum reduction) and a weighted EmbeddingBagCollection.
"""

import numpy as np
import pytest
import torch
from torch import nn

from recship.export import ExportConfig, export_model
from recship.export.artifact import Manifest, open_artifact
from recship.export.blocks import DEFAULT_ROW_BLOCK, run_in_blocks
from recship.models import TwoTower
from recship.models.dlrm import BuiltinDLRM, DLRMConfig
from model_requests import SMALL_ROWS, ModelInputs, in_process, random_request, runnable_aoti

# -- run_in_blocks, against an exact reference ------------------------------------------------------------


def _exact(num_features: int, calls: list):
    """A stand-in model whose output rows are exact in float32 (small integer sums): row i gets the sum of its
    dense values plus, per feature f, (f + 1) x the sum of its ids (times their weights). Records each call's batch."""

    def model(dense, lengths, values, weights=None):
        batch = dense.shape[0]
        calls.append(batch)
        per = lengths.view(num_features, batch).long()
        row = torch.arange(batch).repeat(num_features).repeat_interleave(per.reshape(-1))
        feature = torch.arange(num_features).repeat_interleave(batch).repeat_interleave(per.reshape(-1))
        contrib = values.double() * (feature + 1).double() * (weights.double() if weights is not None else 1.0)
        out = dense.double().sum(dim=1).index_add(0, row, contrib)
        return {"y": out.unsqueeze(1).float(), "z": torch.stack([out, -out], dim=1).float()}

    return model


def _reference(num_features, dense, lengths, values, weights):
    batch = dense.shape[0]
    per = lengths.view(num_features, batch).tolist()
    out, at = dense.double().sum(dim=1).tolist(), 0
    for f in range(num_features):
        for i in range(batch):
            for _ in range(per[f][i]):
                out[i] += float(values[at]) * (f + 1) * (float(weights[at]) if weights is not None else 1.0)
                at += 1
    return torch.tensor(out, dtype=torch.float64).unsqueeze(1).float()


@pytest.mark.parametrize("seed", range(12))
def test_blocks_give_every_row_its_own_ids_and_each_forward_exactly_rows_examples(seed):
    g = torch.Generator().manual_seed(seed)
    num_features = int(torch.randint(1, 5, (1,), generator=g))
    batch = int(torch.randint(1, 150, (1,), generator=g))
    rows = [1, 3, 8, 64, 200][seed % 5]
    lengths = torch.randint(0, 4, (num_features * batch,), generator=g).to(torch.int32)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    weights = torch.randint(0, 4, (values.numel(),), generator=g).float() if seed % 2 else None
    dense = torch.randint(-5, 5, (batch, seed % 3), generator=g).float()
    calls: list = []
    got = run_in_blocks(_exact(num_features, calls), rows, num_features, dense, lengths, values, weights)
    want = _reference(num_features, dense, lengths, values, weights)
    torch.testing.assert_close(got["y"], want, rtol=0, atol=0)
    assert got["z"].shape == (batch, 2)
    assert calls == [rows] * -(-batch // rows)  # every forward: exactly `rows` examples, the last one padded


def test_zero_rows_runs_the_batch_whole_and_mismatched_inputs_reach_the_model_unchanged():
    calls: list = []
    model = _exact(2, calls)
    dense, lengths, values = torch.zeros(5, 1), torch.ones(10, dtype=torch.int32), torch.arange(10)
    run_in_blocks(model, 0, 2, dense, lengths, values)
    assert calls == [5]
    seen = []
    run_in_blocks(lambda *args: seen.append(args) or {}, 4, 2, dense, lengths[:9], values)  # lengths do not fit B
    assert len(seen) == 1 and seen[0][1].numel() == 9


# -- artifacts: a request alone, and inside batches of any composition ---------------------------------------

OTHER_SIZES = (1, 9, 25, 57, 121, 200)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, small_artifacts):
    """name -> artifact folder (model.pt + model.pt2 where a compiler is present), default row_block."""
    torch.manual_seed(0)
    wide = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=SMALL_ROWS, embedding_dim=16, dense_arch=[512, 16], over_arch=[512, 256]))
    tower = TwoTower(num_users=40, num_items=60, num_countries=5, num_categories=7, dim=16)
    out = {}
    for name, module in (("dlrm", wide), ("two_tower", tower)):
        path = tmp_path_factory.mktemp("invariance") / name
        export_model(module, ExportConfig(out=str(path), progress=False, validation_batches=1, validation_batch_size=16, format="both"))
        out[name] = path
    out["weighted"] = small_artifacts("emb", "int8", "cpu", "both")
    return out


def _merge(requests):
    """The requests as one batch: request 0's examples first, then request 1's..."""
    sparse = {f: [row for r in requests for row in r[0][f]] for f in requests[0][0]}
    dense = None if requests[0][1] is None else np.concatenate([r[1] for r in requests])
    weights = None if requests[0][2] is None else {f: [w for r in requests for w in r[2][f]] for f in requests[0][2]}
    return sparse, dense, weights


def _answers(model, manifest, seed: int):
    """(the request's answer alone, its answers inside random batches) for a random request of 1-20 examples."""
    inputs, names = ModelInputs.of(manifest), manifest.feature_names
    g = np.random.default_rng(seed)
    request = random_request(inputs, int(g.integers(1, 21)), g)
    batch = len(request[0][names[0]])
    alone = in_process(model, *request, names=names)
    inside = []
    for _ in range(4):
        others = [random_request(inputs, int(g.choice(OTHER_SIZES)), g) for _ in range(int(g.integers(1, 3)))]
        at = int(g.integers(0, len(others) + 1))
        start = sum(len(r[0][names[0]]) for r in others[:at])
        merged = in_process(model, *_merge(others[:at] + [request] + others[at:]), names=names)
        inside.append({k: v[start:start + batch] for k, v in merged.items()})
    return alone, inside


@pytest.mark.parametrize("fmt", ["torchscript", "aoti"])
@pytest.mark.parametrize("name", ["dlrm", "two_tower", "weighted"])
def test_a_request_gets_the_same_bits_alone_and_batched_at_any_thread_count(artifacts, name, fmt):
    path = runnable_aoti(lambda: artifacts[name]) if fmt == "aoti" else artifacts[name]
    model, manifest = open_artifact(path, format=fmt)
    assert manifest.row_block == DEFAULT_ROW_BLOCK
    threads = torch.get_num_threads()
    try:
        reference = None
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            for seed in range(3):
                alone, inside = _answers(model, manifest, seed)
                for got in inside:
                    for k in alone:
                        np.testing.assert_array_equal(got[k], alone[k], err_msg=f"{name} {fmt} output {k}, {n} threads, seed {seed}")
                if seed == 0:  # and the same bits whatever the thread count
                    if reference is None:
                        reference = alone
                    for k in alone:
                        np.testing.assert_array_equal(alone[k], reference[k], err_msg=f"{name} {fmt} output {k}: {n} threads vs 1")
    finally:
        torch.set_num_threads(threads)


def test_without_blocks_the_wide_dlrm_does_depend_on_its_batch(artifacts):
    """What the blocks remove: run whole (row_block 0), the wide DLRM's answer for a request changes with its batch
    on this machine's kernels (else the test above could not fail here, and this one says so)."""
    model, manifest = open_artifact(artifacts["dlrm"], format="torchscript")
    differs = 0
    for seed in range(3):
        alone, inside = _answers(model.model, manifest, seed)  # the loaded model itself, unblocked
        differs += sum(not np.array_equal(got["logit"], alone["logit"]) for got in inside)
    if differs == 0:
        pytest.skip("this CPU's GEMM kernels gave the same bits at every batch size tried: nothing for the blocks to fix here")
    assert differs > 0


def test_the_sample_is_recorded_through_the_blocks_and_old_artifacts_run_whole(artifacts, tmp_path):
    """A manifest without row_block (artifacts exported before it) loads and runs whole batches; row_block 0 exports so."""
    torch.manual_seed(1)
    module = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=SMALL_ROWS, embedding_dim=8, dense_arch=[16], over_arch=[16]))
    export_model(module, ExportConfig(out=str(tmp_path / "a"), progress=False, validation_batches=1, validation_batch_size=16,
                                      format="torchscript", row_block=0))
    manifest = Manifest.read(tmp_path / "a")
    assert manifest.row_block == 0
    model, _ = open_artifact(tmp_path / "a")  # the sample self-check passes
    assert not hasattr(model, "rows")  # not wrapped: whole batches
    with pytest.raises(ValueError, match="row_block must be an integer >= 0"):
        ExportConfig(out=str(tmp_path / "b"), row_block=-1)
