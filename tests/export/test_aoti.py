"""The flat inference forward and the AOTInductor artifact (model.pt2).

References: the quantized modules' own forwards (QuantEmbeddingBagCollection and the
inference-sharded collection, KJT in) for the flat lookup, bitwise; the artifact's
TorchScript model for model.pt2, bitwise, on random requests of batch 1, 7 and 513
(and requests with 0 and 1 ids, the sizes torch.export likes to specialise), except
where inductor generates a reduction itself (the two-tower's dot product: a few ulp).
"""

import itertools
import os
import json
import shutil

import pytest
import torch

from recship.contract.schema import problems
from recship.export.artifact import AotiModel, ArtifactError, Manifest, open_artifact
from recship.export.blocks import unwrapped
from recship.quantize.sharded import shard_quant_model
from recship.quantize import QuantConfig
from recship.quantize.flat import FlatPooledLookup
from recship.quantize import quantize_embedding_bag_collection
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

from model_requests import ModelInputs, in_process, model_repo, random_request

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                    reason="AOTInductor needs a C++ compiler (g++)")

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=8, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", num_embeddings=60, embedding_dim=16, feature_names=["f1", "g1"]),
    EmbeddingBagConfig(name="t2", num_embeddings=70, embedding_dim=24, feature_names=["f2"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t3", num_embeddings=80, embedding_dim=8, feature_names=["f3"]),
]
NAMES = [f for t in TABLES for f in t.feature_names]
ROWS = [t.num_embeddings for t in TABLES for _ in t.feature_names]


def _request(batch, weighted, g, rows=ROWS, out_of_range=0):
    """lengths [F*B] int32, values [N] int64 inside each table (``out_of_range``: up to that many past its end)."""
    lengths = torch.randint(0, 4, (len(rows) * batch,), generator=g)
    limit = torch.tensor(rows).repeat_interleave(batch).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * (limit + out_of_range)).long()
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return lengths.to(torch.int32), values, weights


CASES = [  # (weighted, type, sharding, shards)
    *[(w, dt, None, 1) for w, dt in itertools.product((False, True), ("int8", "int4", "fp16"))],
    *[(w, dt, s, n) for w, dt, s, n in itertools.product((False, True), ("int8",), ("table_wise", "row_wise"), (1, 3))],
    (True, "fp16", "column_wise", 2), (False, "fp16", "column_wise", 3),
]


@pytest.mark.parametrize("weighted, data_type, sharding, shards", CASES)
def test_flat_lookup_equals_the_quantized_modules_bitwise(weighted, data_type, sharding, shards):
    """SUM and MEAN, weighted or not, a modulo feature, every inference sharding; eager and TorchScript."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES, is_weighted=weighted)
    quantized, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype=data_type, id_policy={"f3": "modulo"}))
    module = quantized if sharding is None else shard_quant_model(quantized, shards=shards, sharding=sharding)[0]
    flat = FlatPooledLookup.of(module)
    scripted = torch.jit.script(flat)
    g = torch.Generator().manual_seed(1)
    for batch in (1, 5, 33):
        # f3 (modulo) gets ids past its table: hashed, by both
        lengths, values, weights = _request(batch, weighted, g)
        f3 = slice(int(lengths[: NAMES.index("f3") * batch].sum()), None)
        values[f3] += 80 * torch.randint(0, 3, values[f3].shape, generator=g)
        want = module(KeyedJaggedTensor(keys=NAMES, values=values, lengths=lengths, weights=weights)).values()
        assert torch.equal(flat(lengths, values, weights), want)
        assert torch.equal(scripted(lengths, values, weights), want)


def test_flat_lookup_refuses_an_out_of_range_id_with_the_id_rules_message():
    torch.manual_seed(0)
    quantized, _ = quantize_embedding_bag_collection(EmbeddingBagCollection(TABLES), QuantConfig(dtype="int8"))
    scripted = torch.jit.script(FlatPooledLookup.of(shard_quant_model(quantized, shards=2, sharding="row_wise")[0]))
    batch = 3
    lengths = torch.ones(len(NAMES) * batch, dtype=torch.int32)
    for feature, bad in (("f0", -1), ("f2", 70), ("g1", 10**9)):
        values = torch.zeros(len(NAMES) * batch, dtype=torch.int64)
        values[NAMES.index(feature) * batch + 1] = bad
        rows = ROWS[NAMES.index(feature)]
        with pytest.raises(Exception, match=f"feature '{feature}': id {bad} is out of range \\[0, {rows}\\)"):
            scripted(lengths, values, None)


# -- the AOTInductor artifact ------------------------------------------------------


def _random_requests(manifest, seed):
    g = torch.Generator().manual_seed(seed)
    rows = [f.rows for f in manifest.sparse_features]
    for batch in (1, 7, 513):
        lengths, values, weights = _request(batch, manifest.weighted, g, rows)
        yield torch.rand(batch, manifest.num_dense, generator=g), lengths, values, weights
    for n_ids in (0, 1):  # sizes 0 and 1: torch.export must not have specialised them away
        lengths = torch.zeros(len(rows) * 2, dtype=torch.int32)
        lengths[: n_ids] = 1
        values = torch.zeros(n_ids, dtype=torch.int64)
        yield torch.rand(2, manifest.num_dense, generator=g), lengths, values, torch.rand(n_ids) if manifest.weighted else None


@needs_compiler
@pytest.mark.parametrize("model, shards", [("dlrm", 1), ("emb", 2)], ids=["dlrm", "emb-weighted-mean-modulo-rowwise2"])
def test_aoti_artifact_equals_torchscript_bitwise(small_artifacts, model, shards):
    path = small_artifacts(model, "int8", "cpu", "both", shards)
    assert problems(json.loads((path / "manifest.json").read_text())) == []
    manifest = Manifest.read(path)
    assert manifest.aoti is not None and (path / "model.pt2").is_file()
    assert manifest.aoti.target_isa == "x86-64-v3" and manifest.aoti.torch == torch.__version__
    assert manifest.aoti.output_order == list(manifest.outputs)
    compiled, _ = open_artifact(path)  # auto: model.pt2 where it runs, self-checked on the sample
    scripted, _ = open_artifact(path, format="torchscript")
    assert isinstance(unwrapped(compiled), AotiModel) and not isinstance(unwrapped(scripted), AotiModel)
    with torch.no_grad():
        for dense, lengths, values, weights in _random_requests(manifest, 3):
            want, got = scripted(dense, lengths, values, weights), compiled(dense, lengths, values, weights)
            assert list(got) == list(want)
            for k in want:
                assert torch.equal(got[k], want[k]), (k, dense.shape[0], values.numel())


@needs_compiler
def test_aoti_model_checks_what_the_compiled_code_would_not(small_artifacts):
    """AOTI reads whatever memory it is given: shapes and dtypes are refused before it, ids by its assert."""
    path = small_artifacts("dlrm", "int8", "cpu", "both")
    compiled, manifest = open_artifact(path, format="aoti")
    f = len(manifest.sparse_features)
    dense, lengths, values = torch.rand(2, 13), torch.ones(2 * f, dtype=torch.int32), torch.zeros(2 * f, dtype=torch.int64)
    compiled(dense, lengths, values)
    for bad, match in [
        ((dense, lengths[:-1], values), "lengths must be int32"),
        ((dense, lengths.long(), values), "lengths must be int32"),
        ((dense, lengths, values.int()), "values must be int64"),
        ((dense[:, :12], lengths, values), "dense must be float32"),
        ((dense.double(), lengths, values), "dense must be float32"),
        ((dense, lengths, values[:-1]), "sum to the"),
    ]:
        with pytest.raises(ValueError, match=match):
            compiled(*bad)
    values[5] = 10**6
    with pytest.raises(RuntimeError, match="out of range"):
        compiled(dense, lengths, values)


@needs_compiler
def test_open_artifact_format_choice_and_a_tampered_package(small_artifacts, small_artifact, tmp_path):
    with pytest.raises(ArtifactError, match="no model.pt2"):
        open_artifact(small_artifact, format="aoti")
    model, _ = open_artifact(small_artifact)  # auto on a TorchScript-only artifact
    assert not isinstance(unwrapped(model), AotiModel)
    copy = tmp_path / "a"
    shutil.copytree(small_artifacts("dlrm", "int8", "cpu", "both"), copy)
    data = bytearray((copy / "model.pt2").read_bytes())
    data[len(data) // 2] ^= 1
    (copy / "model.pt2").write_bytes(bytes(data))
    for fmt in ("aoti", "auto", "torchscript"):  # a version is verified as a unit, whichever file runs
        with pytest.raises(ArtifactError, match="model.pt2: sha256 .* does not match"):
            open_artifact(copy, format=fmt)
    data[len(data) // 2] ^= 1
    (copy / "model.pt2").write_bytes(bytes(data))
    raw = json.loads((copy / "manifest.json").read_text())
    raw["aoti"]["torch"] = "1.0.0"
    (copy / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="compiled by torch 1.0.0"):
        open_artifact(copy, format="aoti")
    model, _ = open_artifact(copy, format="auto")  # falls back to model.pt
    assert not isinstance(unwrapped(model), AotiModel)


@needs_compiler
def test_two_tower_with_an_embedding_collection_compiles(tmp_path):
    """The unpooled lookups (EmbeddingCollection) of a user's model, through export_model, bitwise."""
    from recship.export import ExportConfig, export_model
    from recship.models import TwoTower

    torch.manual_seed(0)
    export_model(TwoTower(num_users=30, num_items=40, dim=8), ExportConfig(
        out=str(tmp_path / "tt"), dtype="int4", progress=False, format="both", validation_batches=1, validation_batch_size=16,
        id_policy={"history": "modulo"}))
    compiled, manifest = open_artifact(tmp_path / "tt", format="aoti")
    scripted, _ = open_artifact(tmp_path / "tt", format="torchscript")
    with torch.no_grad():
        for dense, lengths, values, weights in _random_requests(manifest, 5):
            want, got = scripted(dense, lengths, values, weights), compiled(dense, lengths, values, weights)
            # the lookups and the MLPs (aten kernels in both) are bitwise; the dot product is a reduction
            # inductor generates itself, summed in another order: a few ulp (|score| < 1 here)
            assert torch.equal(got["user_embedding"], want["user_embedding"])
            assert torch.equal(got["item_embedding"], want["item_embedding"])
            assert torch.allclose(got["score"], want["score"], rtol=0, atol=1e-7), (got["score"] - want["score"]).abs().max()


@needs_compiler
@pytest.mark.parametrize("model_format", ["auto", "torchscript"])
def test_the_server_runs_model_pt2_unless_told_otherwise(small_artifacts, tmp_path, model_format):
    """Batched over gRPC, answers equal the chosen model in process; bad requests are refused before it."""
    import numpy as np

    from recship.serving import PredictClient
    from recship.serving.server import Server, ServerConfig

    model_repo(tmp_path, {"dlrm": small_artifacts("dlrm", "int8", "cpu", "both")})
    model, manifest = open_artifact(tmp_path / "dlrm" / "1", format="aoti" if model_format == "auto" else "torchscript")
    server = Server(ServerConfig(model_repo=str(tmp_path), port=0, max_delay_ms=5, model_format=model_format))
    try:
        assert server.repo.get("dlrm").format == ("aoti" if model_format == "auto" else "torchscript")
        g = np.random.default_rng(0)
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            for batch in (1, 7, 33):
                sparse, dense, _ = random_request(ModelInputs.of(manifest), batch, g)
                got = client.predict("dlrm", sparse, dense)
                want = in_process(model, sparse, dense)
                for k in want:
                    np.testing.assert_array_equal(got[k], want[k])
            sparse["cat_3"][0] = [manifest.sparse_features[3].rows]
            import grpc

            with pytest.raises(grpc.RpcError) as e:
                client.predict("dlrm", sparse, dense)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in e.value.details()
    finally:
        server.stop()
