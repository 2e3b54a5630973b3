"""``torchrec.inference.model_packager`` and ``state_dict_transform`` through the import map: a PredictFactory saved
with its configs into a torch.package loads back through the package's loader module and builds the predict module its
pickled config describes (the same outputs as building it directly); on 2 gloo ranks a row- and table-wise sharded
state_dict gathers to the unsharded weights and moves to a device keeping every key on every rank."""

import sys
import textwrap
import types
from typing import Dict

import pytest
import torch
from torch import nn

from gloo_ranks import run_ranks
from tutorials.notebook import run_snippet

FACTORY = '''
import torch
from recship.inference import (DEFAULT_CAT_NAMES, DLRMModelConfig, DLRMPredictModule, EmbeddingBagCollection,
                               EmbeddingBagConfig, PredictFactory, load_config_text, load_pickle_config)


class SmallDLRMFactory(PredictFactory):
    """Builds a float DLRM predict module from the package's configs (its seed and tables)."""

    def create_predict_module(self):
        config = load_pickle_config("model_config", DLRMModelConfig)
        torch.manual_seed(int(load_config_text("seed")))
        tables = [EmbeddingBagConfig(name="t_" + f, embedding_dim=config.embedding_dim, num_embeddings=config.num_embeddings,
                                     feature_names=[f]) for f in config.id_list_features_keys]
        return DLRMPredictModule(EmbeddingBagCollection(tables), config.dense_in_features, config.dense_arch_layer_sizes,
                                 config.over_arch_layer_sizes, config.id_list_features_keys)

    def batching_metadata(self):
        return {"float_features": "dense", "id_list_features": "sparse"}

    def result_metadata(self):
        return "dict_of_tensor"

    def run_weights_independent_tranformations(self, m):
        return m

    def run_weights_dependent_transformations(self, m):
        return m
'''


@pytest.fixture(scope="module")
def trec():
    return run_snippet("torchrec_inference_modules")


def _config(trec):
    args = types.SimpleNamespace(batch_size=4, num_embedding_features=30)
    torch.manual_seed(5)
    sample = trec["create_training_batch"](args)
    assert sample.dense_features.shape == (4, 13) and sample.sparse_features.keys() == trec["DEFAULT_CAT_NAMES"]
    keys = ["cat_0", "cat_1", "cat_2"]
    return trec["DLRMModelConfig"](dense_arch_layer_sizes=[8, 4], dense_in_features=13, embedding_dim=4, id_list_features_keys=keys,
                                   num_embeddings_per_feature=[30, 30, 30], num_embeddings=30, over_arch_layer_sizes=[4, 1],
                                   sample_input=sample)


def test_a_predict_factory_round_trips_through_a_torch_package(trec, tmp_path, monkeypatch):
    (tmp_path / "small_dlrm_factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    import small_dlrm_factory

    class Packager(trec["PredictFactoryPackager"]):
        @classmethod
        def set_extern_modules(cls, pe):
            pe.extern(["torch", "torch.**", "recship", "recship.**", "numpy", "numpy.**", "fbgemm_gpu", "fbgemm_gpu.**"])

        @classmethod
        def set_mocked_modules(cls, pe):
            pass

    config = _config(trec)
    path = tmp_path / "factory.pt"
    Packager.save_predict_factory(small_dlrm_factory.SmallDLRMFactory, {"model_config": config, "seed": "7"}, path,
                                  extra_files={"notes.txt": "int8 tables", "blob.bin": b"\x00\x01"})
    importer = torch.package.PackageImporter(str(path))
    factory_cls = getattr(importer.import_module(trec["LOADER_MODULE"]), "MODULE_FACTORY")
    assert factory_cls.__name__ == "SmallDLRMFactory" and factory_cls is not small_dlrm_factory.SmallDLRMFactory
    assert importer.load_text("extra_files", "notes.txt") == "int8 tables" and importer.load_binary("extra_files", "blob.bin") == b"\x00\x01"
    module = factory_cls().create_predict_module()

    torch.manual_seed(7)  # the direct build: the same seed, the same constructor
    from recship.inference import DLRMPredictModule, EmbeddingBagCollection, EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name="t_" + f, embedding_dim=4, num_embeddings=30, feature_names=[f]) for f in config.id_list_features_keys]
    direct = DLRMPredictModule(EmbeddingBagCollection(tables), 13, [8, 4], [4, 1], config.id_list_features_keys)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 3, (12,), generator=g, dtype=torch.int32)
    batch = {"float_features": torch.rand(4, 13, generator=g), "id_list_features.lengths": lengths,
             "id_list_features.values": torch.randint(0, 30, (int(lengths.sum()),), generator=g)}
    got, want = module(batch)["default"], direct(batch)["default"]
    assert got.shape == (4,) and torch.equal(got, want)
    with pytest.raises(ValueError, match="unsupported type"):
        Packager.save_predict_factory(small_dlrm_factory.SmallDLRMFactory, {}, tmp_path / "bad.pt", extra_files={"x": 3})
    with pytest.raises(RuntimeError, match="call them from code the package holds"):
        trec["load_config_text"]("seed")
    sys.modules.pop("small_dlrm_factory", None)


def _sharded_worker(rank: int, world_size: int) -> Dict[str, object]:
    from recship.distributed import DistributedModelParallel, ShardingPlan, construct_module_sharding_plan, row_wise, table_wise
    from recship.inference import state_dict_all_gather_keys, state_dict_gather, state_dict_to_device
    from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    torch.manual_seed(0)
    model = nn.Module()
    model.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
                                        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=6, feature_names=["b"])])
    model.out = nn.Linear(4, 1)
    whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, {"t0": row_wise(), "t1": table_wise(rank=1)},
                                                                local_size=world_size, world_size=world_size, device_type="cpu")})
    dmp = DistributedModelParallel(model, plan=plan)
    src = dmp.state_dict()
    pg = torch.distributed.group.WORLD
    keys = state_dict_all_gather_keys(src, pg)
    moved = state_dict_to_device(src, pg, torch.device("cpu"))
    dst = {k: torch.zeros_like(v) for k, v in whole.items()}
    dst = {k[len("module."):] if k.startswith("module.") else k: v for k, v in dst.items()}
    src_plain = {k[len("module."):] if k.startswith("module.") else k: v for k, v in src.items()}
    state_dict_gather(src_plain, dst)
    return {"keys": keys, "moved_keys": sorted(moved), "sharded": sorted(k for k, v in src.items() if isinstance(v, ShardedTensor)),
            "dst": dst, "whole": whole}


def test_sharded_state_dicts_gather_and_move_on_two_ranks():
    results = run_ranks(_sharded_worker, 2)
    first = results[0]
    assert first["keys"] == results[1]["keys"] == first["moved_keys"] == results[1]["moved_keys"]
    assert any(k.endswith("ebc.embedding_bags.t0.weight") for k in first["sharded"])
    for key, value in first["whole"].items():
        assert torch.equal(first["dst"][key], value), key  # rank 0 holds the gathered tables


def test_a_dlrm_predict_modules_model_exports_and_answers_as_its_predict_forward(trec, tmp_path):
    """The predict module decodes a batch for its model; recship's server decodes requests itself, so the model inside
    (TorchRec's DLRM: recship's model contract) is what ``recship export`` writes, and the artifact answers what
    ``predict_forward`` does (fp32 tables)."""
    import numpy as np

    from model_requests import in_process
    from recship.export import ExportConfig, export_model
    from recship.export.artifact import open_artifact
    from recship.inference import EmbeddingBagCollection, EmbeddingBagConfig

    keys = ["cat_0", "cat_1"]
    torch.manual_seed(3)
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=20, feature_names=[f]) for f in keys]
    module = trec["DLRMPredictModule"](EmbeddingBagCollection(tables), 3, [8, 4], [4, 1], keys)
    export_model(module.predict_module, ExportConfig(out=str(tmp_path / "a"), dtype="fp32", progress=False, validation_batches=1,
                                                     validation_batch_size=8, format="torchscript"))
    artifact, _ = open_artifact(tmp_path / "a")
    g = np.random.default_rng(0)
    sparse = {f: [g.integers(0, 20, size=g.integers(0, 4)).tolist() for _ in range(5)] for f in keys}
    dense = g.random((5, 3), dtype=np.float32)
    got = in_process(artifact, sparse, dense, names=keys)["output"]
    batch = {"float_features": torch.from_numpy(dense),
             "id_list_features.lengths": torch.tensor([len(r) for f in keys for r in sparse[f]]),
             "id_list_features.values": torch.tensor([i for f in keys for r in sparse[f] for i in r], dtype=torch.int64)}
    want = module(batch)["default"]
    np.testing.assert_allclose(torch.sigmoid(torch.from_numpy(got)).reshape(-1).numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
