"""recship: train, quantize, export and serve recommendation models with large embedding tables.

The public names follow TorchRec's tutorials; recship is built on torch and
fbgemm_gpu only. Names and subpackages load on first use (PEP 562), so
``import recship``, ``recship --version`` and the gRPC client (numpy + grpc) do
not load torch; fbgemm_gpu is imported by the parts that need it.
"""

import importlib
from typing import TYPE_CHECKING

from recship.fbgemm import install as _install_fbgemm_ops
from recship.lazy import lazy_names
from recship.logs import ignore_dependency_notices

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "Multistreamable", "Pipelineable",
                     "maybe_td_to_kjt", "validate_keyed_jagged_tensor"], "recship.sparse"),
    **dict.fromkeys(
        [
            "BaseEmbeddingConfig", "CountBasedEvictionPolicy", "CountTimestampMixedEvictionPolicy", "EmbeddingTableConfig",
            "FeatureL2NormBasedEvictionPolicy", "FeatureScoreBasedEvictionPolicy", "FeatureScoreMapping",
            "NoEvictionPolicy", "TimestampBasedEvictionPolicy", "VirtualTableEvictionPolicy",
        ],
        "recship.modules.embedding_configs",
    ),
    **dict.fromkeys(["data_type_to_dtype", "data_type_to_sparse_type", "dtype_to_data_type", "pooling_type_to_pooling_mode",
                     "pooling_type_to_str"], "recship.names"),
    **dict.fromkeys(["EmbeddingBagCollectionInterface", "EmbeddingCollectionInterface", "get_embedding_names_by_table",
                     "process_pooled_embeddings", "reorder_inverse_indices"], "recship.modules.embedding_modules"),
    **dict.fromkeys(
        [
            "DataType", "DistributedModelParallel", "EmbOptimType", "EmbeddingBagCollection", "EmbeddingBagConfig",
            "EmbeddingCollection", "EmbeddingConfig", "EmbeddingShardingPlanner", "FusedOptimizerConfig",
            "ParameterConstraints", "PoolingType", "ShardingPlan", "ShardingType", "Topology", "materialize",
        ],
        "recship.trainer",
    ),
    "QuantConfig": "recship.quantize.quantizer",
}
__all__ = sorted(_EXPORTS) + ["__version__"]
_names_getattr, __dir__ = lazy_names(__name__, _EXPORTS, globals())
# TorchRec's subpackages that recship keeps in one module (the README's import map), for code that reaches them as
# attributes after `import recship as torchrec` (`torchrec.optim.RowWiseAdagrad`)
_MODULE_ALIASES = {"optim": "recship.distributed"}


def __getattr__(name: str) -> object:
    if name in _MODULE_ALIASES:
        return importlib.import_module(_MODULE_ALIASES[name])
    return _names_getattr(name)

# torch.ops.fbgemm.* works after `import recship` as after `import torchrec` (fbgemm_gpu loads on first use)
_install_fbgemm_ops()
ignore_dependency_notices()  # before any import of torch or fbgemm_gpu, in every process that imports recship


if TYPE_CHECKING:  # what __getattr__ returns, for type checkers
    from recship import distributed as distributed
    from recship.quantize.quantizer import QuantConfig as QuantConfig
    from recship.sparse import JaggedTensor as JaggedTensor, KeyedJaggedTensor as KeyedJaggedTensor, KeyedTensor as KeyedTensor
    from recship.trainer import DataType as DataType, DistributedModelParallel as DistributedModelParallel
    from recship.trainer import EmbeddingBagCollection as EmbeddingBagCollection, EmbeddingBagConfig as EmbeddingBagConfig
    from recship.trainer import EmbeddingCollection as EmbeddingCollection, EmbeddingConfig as EmbeddingConfig
    from recship.trainer import EmbeddingShardingPlanner as EmbeddingShardingPlanner, EmbOptimType as EmbOptimType
    from recship.trainer import FusedOptimizerConfig as FusedOptimizerConfig, ParameterConstraints as ParameterConstraints
    from recship.trainer import PoolingType as PoolingType, ShardingPlan as ShardingPlan, ShardingType as ShardingType
    from recship.trainer import Topology as Topology, materialize as materialize
