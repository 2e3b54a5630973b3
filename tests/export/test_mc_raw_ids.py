"""A served managed-collision model takes its raw ids: the manifest's ``id_bound`` (recship/contract/manifest.py SparseFeature).

A ranker whose user ids are remapped by a sorted-ids module with input_hash_size 2**40 and whose item ids by one with
TorchRec's default range (2**63 - 1) is profiled on raw ids drawn from those ranges (slots go to ids far above its
16 and 8 rows, the ranges' last ids among them) and exported. Its manifest records each feature's raw-id range; the
artifact in process equals a plain-PyTorch reference that remaps each raw id with a dict of the module's buffers;
both fronts and recship_predict answer raw ids up to the bound - 1 bitwise as the artifact in process and refuse an
id at the bound (or negative) as they refuse any out-of-range id, in the same words. The field's edits (valid,
of another type, below rows, past 2**63 - 1, on a modulo feature) get the same answer from Python and C++.
"""

import json
import shutil
import subprocess

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from recship.contract.schema import problems
from recship.export import ExportConfig, ExportError, export_model
from recship.export.any_model import raw_id_bounds
from recship.export.artifact import MAX_ID_BOUND, ArtifactError, Manifest, open_artifact
from recship.sparse import KeyedJaggedTensor
from recship.sparse.ids import out_of_range_message
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.entry_point import describe_model
from recship.trainer.managed_collisions import (LFU_EvictionPolicy, ManagedCollisionCollection, ManagedCollisionEmbeddingBagCollection,
                                                MCHManagedCollisionModule)

from model_requests import assert_served_as_in_process, in_process, request_file

ROWS = {"t_user": 16, "t_item": 8}
BOUND = {"user": 2**40, "item": MAX_ID_BOUND}  # user: input_hash_size 2**40; item: TorchRec's default, 2**63 - 1
TABLE = {"user": "t_user", "item": "t_item"}


class RawIdRanker(nn.Module):
    """[B, 1] logits of dense [B, 2] and user / item raw ids remapped by managed collisions."""

    num_dense = 2

    def __init__(self, user_hash_size: int = BOUND["user"], hash_func=None) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name=t, embedding_dim=4, num_embeddings=n, feature_names=[f])
                  for (f, t), n in zip(TABLE.items(), ROWS.values())]
        cpu = torch.device("cpu")
        self.mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables), ManagedCollisionCollection({
            "t_user": MCHManagedCollisionModule(zch_size=ROWS["t_user"], device=cpu, eviction_policy=LFU_EvictionPolicy(),
                                                eviction_interval=1, input_hash_size=user_hash_size, input_hash_func=hash_func),
            "t_item": MCHManagedCollisionModule(zch_size=ROWS["t_item"], device=cpu, eviction_policy=LFU_EvictionPolicy(),
                                                eviction_interval=1),
        }, tables))
        self.over = nn.Linear(2 + 8, 1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled, _ = self.mc(features)
        return self.over(torch.cat([dense, pooled.values()], dim=1))


def _pools(seed: int = 0):
    """feature -> [24] int64: the raw ids the model is profiled on, each range's last id among them."""
    g = np.random.default_rng(seed)
    return {f: np.concatenate([[b - 1], g.integers(b // 2, b - 1, size=23)]).astype(np.int64) for f, b in BOUND.items()}


def _raw_request(batch: int, seed: int):
    """(sparse, dense [batch, 2]): 0-4 ids per example and feature, half from the profiled pools, half anywhere in
    [0, bound) (misses, mostly), the bound's last id in the first example."""
    g = np.random.default_rng(seed)
    pools = _pools()
    sparse = {}
    for f, b in BOUND.items():
        rows = [[int(pools[f][g.integers(0, 24)]) if g.random() < 0.5 else int(g.integers(0, b)) for _ in range(g.integers(0, 5))]
                for _ in range(batch)]
        rows[0].append(b - 1)
        sparse[f] = rows
    return sparse, g.random((batch, 2), dtype=np.float32)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(artifact folder, the float model): RawIdRanker profiled on 6 batches of pooled raw ids (a quarter of them
    the range's last id, so it holds a slot), exported (fp32)."""
    torch.manual_seed(0)
    model = RawIdRanker()
    g = np.random.default_rng(1)
    pools = _pools()
    for _ in range(6):  # training-mode calls: every call (eviction_interval 1) gives the slots to the most frequent ids
        values = np.concatenate([np.concatenate([pools[f][:1].repeat(8), pools[f][g.integers(0, 24, size=24)]]) for f in BOUND])
        model(torch.rand(16, 2), KeyedJaggedTensor(keys=list(BOUND), values=torch.from_numpy(values),
                                                   lengths=torch.full((32,), 2, dtype=torch.int32)))
    model.eval()
    out = tmp_path_factory.mktemp("mc-raw") / "artifact"
    export_model(model, ExportConfig(out=str(out), model_name="mc", dtype="fp32", progress=False, validation_batches=1,
                                     validation_batch_size=16, format="torchscript"))
    return out, model


def _reference(model: RawIdRanker, sparse, dense) -> np.ndarray:
    """[B, 1] in plain PyTorch: each raw id remapped by a dict of its module's buffers (no slot: the last row),
    pooled sums of the float tables, the linear layer."""
    modules = model.mc._managed_collision_collection._managed_collision_modules
    pooled = [torch.from_numpy(dense)]
    for f, t in TABLE.items():
        raw, rows = modules[t]._mch_sorted_raw_ids.tolist(), modules[t]._mch_remapped_ids_mapping.tolist()
        slot = {r: row for r, row in zip(raw, rows) if r != 2**63 - 1}
        weight = model.mc._embedding_module.embedding_bags[t].weight.detach()
        pooled.append(torch.stack([sum((weight[slot.get(i, ROWS[t] - 1)] for i in bag), torch.zeros(4)) for bag in sparse[f]]))
    with torch.no_grad():
        return model.over(torch.cat(pooled, dim=1)).numpy()


def test_the_manifest_records_each_features_raw_id_range(exported):
    out, model = exported
    raw = json.loads((out / "manifest.json").read_text())
    assert problems(raw) == []
    assert {f["name"]: (f["rows"], f["id_bound"], f["id_policy"]) for f in raw["sparse_features"]} == {
        "user": (16, 2**40, "reject"), "item": (8, 2**63 - 1, "reject")}
    assert {f.name: f.bound for f in Manifest.read(out).sparse_features} == BOUND
    # the rule export follows, module by module: input_hash_size; any id with a hash function or a size of 0; at least rows
    spec = describe_model(model)
    assert raw_id_bounds(model, spec) == BOUND
    assert raw_id_bounds(RawIdRanker(hash_func=lambda ids, size: ids % size), spec)["user"] == MAX_ID_BOUND
    assert raw_id_bounds(RawIdRanker(user_hash_size=0), spec)["user"] == MAX_ID_BOUND
    assert raw_id_bounds(RawIdRanker(user_hash_size=5), spec)["user"] == ROWS["t_user"]
    with pytest.raises(ValueError, match="input_hash_size -1"):
        raw_id_bounds(RawIdRanker(user_hash_size=-1), spec)
    # a front folding raw ids into the rows would hand the remapping other ids than the client's: refused
    with pytest.raises(ExportError, match=r"features \['user'\] are remapped by managed-collision modules: .* not 'modulo'"):
        export_model(model, ExportConfig(out=str(out.parent / "modulo"), dtype="fp32", progress=False, id_policy={"user": "modulo"}))


def test_the_artifact_remaps_raw_ids_as_the_modules_buffers_say(exported):
    out, model = exported
    artifact, manifest = open_artifact(out)
    sparse, dense = _raw_request(64, 7)
    got = in_process(artifact, sparse, dense, names=manifest.feature_names)["output"]
    np.testing.assert_allclose(got, _reference(model, sparse, dense), rtol=1e-5, atol=1e-6)
    modules = model.mc._managed_collision_collection._managed_collision_modules
    for f, t in TABLE.items():  # the request's ids far above the rows hit slots, the range's last id among them
        held = set(modules[t]._mch_sorted_raw_ids.tolist())
        hits = [i for bag in sparse[f] for i in bag if i in held]
        assert len(hits) > 20 and BOUND[f] - 1 in hits and min(hits) > 1000 * ROWS[t]


def test_both_fronts_and_recship_predict_take_raw_ids_and_refuse_ids_past_the_bound(exported, binary, tmp_path):
    out, _ = exported
    artifact, manifest = open_artifact(out, format="torchscript")
    requests = [(*_raw_request(batch, seed), None) for batch, seed in [(1, 1), (9, 2), (200, 3)]]
    wants = [in_process(artifact, sparse, dense, names=manifest.feature_names) for sparse, dense, _ in requests]
    good, _, _ = requests[1]
    # an id at the bound, past it, or negative: refused with the words of any out-of-range id
    bad = [("user", 2**40, 2**40), ("item", 2**63 - 1, MAX_ID_BOUND), ("user", 2**50, 2**40), ("item", -1, MAX_ID_BOUND)]

    def check(client, front):
        meta = client.metadata("mc")  # what a client may send: the raw-id range, not the table's rows
        assert [(f.name, f.rows, f.id_bound) for f in meta.sparse_features] == [(f, ROWS[TABLE[f]], BOUND[f]) for f in BOUND], front
        for f, id, bound in bad:
            sparse = {**good, f: [[id], *good[f][1:]]}
            with pytest.raises(grpc.RpcError) as e:
                client.predict("mc", sparse, requests[1][1])
            assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, out_of_range_message(f, id, bound)), front

    assert_served_as_in_process(out, "mc", requests, wants, binary, tmp_path, check=check)
    for f, id, bound in bad:
        path = request_file(tmp_path / "bad.json", {**good, f: [[id], *good[f][1:]]}, requests[1][1])
        done = subprocess.run([str(binary), str(out), "--request", str(path), "--format", "torchscript"], capture_output=True, text=True)
        assert (done.returncode, done.stderr.strip()) == (2, f"recship_predict: invalid request: {out_of_range_message(f, id, bound)}")


def _verdicts(binary, art):
    """(Python's open_artifact refusal or None, recship_predict's or None) of the artifact folder ``art``."""
    try:
        open_artifact(art)
        python = None
    except ArtifactError as e:
        python = str(e)
    done = subprocess.run([str(binary), str(art), "--format", "torchscript"], capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    cpp = done.stderr.strip().splitlines()[-1].removeprefix("recship_predict: error: ") if done.returncode else None
    return python, cpp


@pytest.mark.parametrize("model, feature, value, error", [
    ("dlrm", 0, 20_000, None),
    ("dlrm", 0, 2**63 - 1, None),
    ("dlrm", 0, 20, None),  # its rows: today's rule written out
    ("dlrm", 3, "9", "sparse_features[3].id_bound must be int, got str"),
    ("dlrm", 3, True, "sparse_features[3].id_bound must be int, got bool"),
    ("dlrm", 3, 40.0, "sparse_features[3].id_bound must be int, got float"),
    ("dlrm", 3, None, "sparse_features[3].id_bound must be int, got NoneType"),
    ("dlrm", 3, 22, "sparse_features[3].id_bound must be >= rows (23), got 22"),
    ("dlrm", 3, -1, "sparse_features[3].id_bound must be >= 1"),
    ("dlrm", 3, 2**63, "sparse_features[3].id_bound must be <= 9223372036854775807"),
    ("emb", 2, 1000, "sparse_features[2].id_policy must be 'reject' (a feature with id_bound)"),
])
def test_python_and_cpp_answer_each_id_bound_alike(small_artifacts, binary, tmp_path, model, feature, value, error):
    art = tmp_path / "art"
    shutil.copytree(small_artifacts(model), art)
    raw = json.loads((art / "manifest.json").read_text())
    raw["sparse_features"][feature]["id_bound"] = value
    (art / "manifest.json").write_text(json.dumps(raw))
    python, cpp = _verdicts(binary, art)
    assert python == cpp == (None if error is None else f"{art}/manifest.json: {error}")
    if error is None:
        assert Manifest.read(art).sparse_features[feature].bound == value
    # the schema holds what it can say (a type, 1 <= id_bound <= 2**63 - 1, the policy); rows are the rule id-bound's
    refused_by = {p.rule for p in problems(raw) if p.where[:2] == ("sparse_features", feature)}
    assert refused_by == (set() if error is None or "rows" in error else {"type"} if "must be int" in error else
                          {"const"} if "id_policy" in error else {"minimum"} if ">= 1" in error else {"maximum"})


def test_a_sample_id_past_the_bound_is_refused_alike(exported, binary, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(exported[0], art)
    manifest = Manifest.read(art)
    values = np.fromfile(art / manifest.sample.inputs["values"].file, dtype="<i8")
    lengths = np.fromfile(art / manifest.sample.inputs["lengths"].file, dtype="<i4")
    b = manifest.sample.batch_size
    assert lengths[:b].sum() > 0 and [f.name for f in manifest.sparse_features] == ["user", "item"]
    values[0] = 2**40  # the first user id: at the bound
    values.astype("<i8").tofile(art / manifest.sample.inputs["values"].file)
    python, cpp = _verdicts(binary, art)
    assert python == cpp == (f"{art}: sample file {manifest.sample.inputs['values'].file!r} is not a valid request: "
                             f"{out_of_range_message('user', 2**40, 2**40)}")
