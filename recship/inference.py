"""TorchRec's ``torchrec.inference`` under one name (the import map sends every ``torchrec.inference`` path here):
``modules`` (quantizing, inference sharding, the predict interface), ``dlrm_predict`` (its DLRM example),
``model_packager`` (predict factories in a torch.package) and ``state_dict_transform`` (gathering sharded weights).

    model = quantize_inference_model(model)                       # EBCs, ECs, FP-EBCs -> their quantized twins (INT8)
    sharded, plan = shard_quant_model(model, world_size=2, compute_device="cpu")

``recship export`` runs the same steps (and validates and writes the artifact); these are for code that does them
by hand. The implementations live in ``recship.quantize.inference`` (quantizing), ``recship.quantize.sharders``
(inference sharding), ``recship.export.predict`` (the predict interface) and ``recship.export.package``; TorchRec's
DLRM example of the predict interface (``dlrm_predict``) is here.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from recship.datasets import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES, Batch, RandomRecDataset
from recship.export.package import (CONFIG_MODULE, LOADER_CODE, LOADER_FACTORY, LOADER_MODULE, PredictFactoryPackager,
                                    load_config_text, load_pickle_config, state_dict_all_gather_keys, state_dict_gather,
                                    state_dict_to_device)
from recship.export.predict import (BatchingMetadata, PredictFactory, PredictModule, QualNameMetadata, get_propogate_device,
                                    set_propogate_device)
from recship.fx import Tracer
from recship.models.dlrm import DLRM
from recship.names import EmbeddingComputeKernel, ShardingType
from recship.quantize.embedding_modules import quant_prep_enable_cache_features_order, quant_prep_enable_register_tbes
from recship.quantize.feature_processed import QuantFeatureProcessedEmbeddingBagCollection
from recship.quantize.inference import (DEFAULT_QUANT_MAPPING, DEFAULT_QUANTIZATION_DTYPE, FEATURE_PROCESSED_EBC_TYPE,
                                        MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT, assign_weights_to_tbe,
                                        get_table_to_weights_from_tbe, quantize_dense, quantize_embeddings, quantize_feature,
                                        quantize_inference_model, set_pruning_data, trim_torch_package_prefix_from_typename)
from recship.quantize.modules import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from recship.quantize.quantizer import QuantConfig
from recship.quantize.sharders import (FUSED_PARAM_BOUNDS_CHECK_MODE, FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP,
                                       FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS, FUSED_PARAM_REGISTER_TBE_BOOL,
                                       QuantEmbeddingBagCollectionSharder, QuantEmbeddingCollectionSharder,
                                       QuantFeatureProcessedEmbeddingBagCollectionSharder, _default_fused_params, default_sharders,
                                       shard_quant_model)
from recship.sparse import KeyedJaggedTensor
from recship.trainer.distributed.types import ModuleSharder
from recship.modules.embedding_configs import EmbeddingBagConfig
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection
from recship.trainer.planner.components import (EmbeddingEnumerator, EmbeddingPerfEstimator, EmbeddingStorageEstimator,
                                               FixedPercentageStorageReservation)
from recship.trainer.planner.types import ParameterConstraints, ShardingPlan


def create_training_batch(args: Any) -> Batch:
    """One random Criteo-shaped batch (``args.batch_size`` examples, one id per categorical feature below
    ``args.num_embedding_features``, the 13 dense features): the DLRM example's sample input."""
    dataset = RandomRecDataset(keys=DEFAULT_CAT_NAMES, batch_size=args.batch_size, hash_size=args.num_embedding_features,
                               ids_per_feature=1, num_dense=len(DEFAULT_INT_NAMES), num_generated_batches=1)
    return next(iter(dataset))


@dataclass
class DLRMModelConfig:
    """The DLRM example's model: its archs' sizes, its features (one table of ``embedding_dim`` each, of
    ``num_embeddings`` rows, or ``num_embeddings_per_feature[i]`` when that is None) and a sample input."""

    dense_arch_layer_sizes: List[int]
    dense_in_features: int
    embedding_dim: int
    id_list_features_keys: List[str]
    num_embeddings_per_feature: List[int]
    num_embeddings: int
    over_arch_layer_sizes: List[int]
    sample_input: Batch


class DLRMPredictModule(PredictModule):
    """A DLRM behind the predict interface: ``batch`` holds "float_features" [B, dense_in_features],
    "id_list_features.lengths" [F * B] and "id_list_features.values" (the ids of ``id_list_features_keys``, key-major);
    the output is {"default": sigmoid of the logits, [B] float32 on the CPU}.

    Args: as ``DLRM`` (``recship.models.dlrm``), and ``id_list_features_keys``: the sparse features' names, in the
    order of the batch's lengths.
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int, dense_arch_layer_sizes: List[int],
                 over_arch_layer_sizes: List[int], id_list_features_keys: List[str],
                 dense_device: Optional[torch.device] = None) -> None:
        module = DLRM(embedding_bag_collection=embedding_bag_collection, dense_in_features=dense_in_features,
                      dense_arch_layer_sizes=dense_arch_layer_sizes, over_arch_layer_sizes=over_arch_layer_sizes,
                      dense_device=dense_device)
        super().__init__(module, None if dense_device is None else str(dense_device))
        self.id_list_features_keys: List[str] = list(id_list_features_keys)

    def predict_forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        kjt = KeyedJaggedTensor(keys=self.id_list_features_keys, values=batch["id_list_features.values"],
                                lengths=batch["id_list_features.lengths"])
        predictions = self.predict_module(batch["float_features"], kjt).sigmoid()
        # one prediction an example: [B, 1] -> [B]
        predictions = predictions.reshape([predictions.size()[0]])
        return {"default": predictions.to(torch.device("cpu"), non_blocking=True).float()}


class DLRMPredictFactory(PredictFactory):
    """Builds the TorchScripted, inference-sharded DLRM predict module of a DLRMModelConfig (its tables INT8, rows
    zero until a state_dict is loaded; dense layers freshly initialised)."""

    def __init__(self, model_config: DLRMModelConfig) -> None:
        self.model_config = model_config

    def create_predict_module(self, world_size: int, device: str) -> nn.Module:  # type: ignore[override]
        """The predict module on ``world_size`` devices of ``device`` ("cpu" or "cuda"), fx-traced and scripted,
        checked once on the config's sample input."""
        set_propogate_device(True)
        c = self.model_config
        tables = [EmbeddingBagConfig(name=f"t_{name}", embedding_dim=c.embedding_dim,
                                     num_embeddings=c.num_embeddings_per_feature[i] if c.num_embeddings is None else c.num_embeddings,
                                     feature_names=[name])
                  for i, name in enumerate(c.id_list_features_keys)]
        module = DLRMPredictModule(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                                   dense_in_features=c.dense_in_features, dense_arch_layer_sizes=c.dense_arch_layer_sizes,
                                   over_arch_layer_sizes=c.over_arch_layer_sizes, id_list_features_keys=c.id_list_features_keys,
                                   dense_device=torch.device(device))
        quantized = quantize_inference_model(module)
        sharded, _ = shard_quant_model(quantized, world_size=world_size, compute_device=device, sharding_device=device)
        batch = sample_batch(c.sample_input, device)
        sharded(batch)
        graph = Tracer(leaf_modules=["IntNBitTableBatchedEmbeddingBagsCodegen"]).trace(sharded)
        traced = torch.fx.GraphModule(sharded, graph)
        traced(batch)
        scripted = torch.jit.script(traced)
        scripted(batch)
        return scripted

    def batching_metadata(self) -> Dict[str, str]:  # type: ignore[override]
        """TorchRec's DLRM example answers kinds, not BatchingMetadata."""
        return {"float_features": "dense", "id_list_features": "sparse"}

    def result_metadata(self) -> str:
        return "dict_of_tensor"

    def run_weights_independent_tranformations(self, predict_module: nn.Module) -> nn.Module:
        return predict_module

    def run_weights_dependent_transformations(self, predict_module: nn.Module) -> nn.Module:
        return predict_module


def sample_batch(sample: Batch, device: Union[str, torch.device]) -> Dict[str, torch.Tensor]:
    """A DLRM predict module's batch (input name -> tensor) from a training Batch."""
    return {"float_features": sample.dense_features.to(device),
            "id_list_features.lengths": sample.sparse_features.lengths().to(device),
            "id_list_features.values": sample.sparse_features.values().to(device)}


def __getattr__(name: str) -> Any:
    """TorchRec's DEFAULT_SHARDERS and DEFAULT_FUSED_PARAMS, built anew each time they are asked for."""
    if name == "DEFAULT_SHARDERS":
        return default_sharders()
    if name == "DEFAULT_FUSED_PARAMS":
        fused: Dict[str, Any] = _default_fused_params()
        return fused
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Batch", "BatchingMetadata", "CONFIG_MODULE", "DEFAULT_CAT_NAMES", "DEFAULT_INT_NAMES", "DEFAULT_QUANTIZATION_DTYPE",
    "DEFAULT_QUANT_MAPPING", "DLRM", "DLRMModelConfig", "DLRMPredictFactory", "DLRMPredictModule", "EmbeddingBagCollection",
    "EmbeddingBagConfig", "EmbeddingCollection", "EmbeddingComputeKernel", "FEATURE_PROCESSED_EBC_TYPE",
    "FUSED_PARAM_BOUNDS_CHECK_MODE", "FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP", "FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS",
    "FUSED_PARAM_REGISTER_TBE_BOOL", "FeatureProcessedEmbeddingBagCollection", "KeyedJaggedTensor", "LOADER_CODE",
    "LOADER_FACTORY", "LOADER_MODULE", "MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT", "ModuleSharder",
    "ParameterConstraints", "PredictFactory", "PredictFactoryPackager", "PredictModule", "QualNameMetadata", "QuantConfig",
    "QuantEmbeddingBagCollection", "QuantEmbeddingBagCollectionSharder", "QuantEmbeddingCollection",
    "QuantEmbeddingCollectionSharder", "QuantFeatureProcessedEmbeddingBagCollection",
    "QuantFeatureProcessedEmbeddingBagCollectionSharder", "RandomRecDataset", "EmbeddingEnumerator", "EmbeddingPerfEstimator",
    "EmbeddingStorageEstimator", "FixedPercentageStorageReservation", "ShardingPlan", "ShardingType", "Tracer",
    "assign_weights_to_tbe", "create_training_batch", "get_propogate_device", "get_table_to_weights_from_tbe",
    "load_config_text", "load_pickle_config", "quant_prep_enable_cache_features_order", "quant_prep_enable_register_tbes",
    "quantize_dense", "quantize_embeddings", "quantize_feature", "quantize_inference_model", "set_pruning_data",
    "set_propogate_device", "shard_quant_model", "state_dict_all_gather_keys", "state_dict_gather", "state_dict_to_device",
    "trim_torch_package_prefix_from_typename",
]
