"""Jagged sparse data types: JaggedTensor, KeyedJaggedTensor, KeyedTensor (and TorchRec's equality helpers), and
the KeyedTensor regrouping of ``torchrec.modules.regroup`` (``KTRegroupAsDict``; recship.sparse.regroup), and
TorchRec's stream interfaces ``Multistreamable`` / ``Pipelineable`` (recship.sparse.streamable)."""

from recship.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor, jt_is_equal, kjt_is_equal
from recship.sparse.regroup import (CacheMixin, DataType, KTRegroupAsDict, PermuteMultiEmbedding, data_type_to_dtype,
                                    is_fx_tracing, module_init, permute_multi_embedding, regroup_kts)
from recship.sparse.streamable import Multistreamable, Pipelineable

__all__ = ["CacheMixin", "DataType", "JaggedTensor", "KTRegroupAsDict", "KeyedJaggedTensor", "KeyedTensor",
           "Multistreamable", "PermuteMultiEmbedding", "Pipelineable", "data_type_to_dtype", "is_fx_tracing", "jt_is_equal", "kjt_is_equal", "module_init",
           "permute_multi_embedding", "regroup_kts"]
