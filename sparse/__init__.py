"""Jagged sparse data types: JaggedTensor, KeyedJaggedTensor, KeyedTensor (and TorchRec's equality helpers), and
TorchRec's other ``torchrec.sparse`` names: the KeyedTensor regrouping of ``torchrec.modules.regroup``
(``KTRegroupAsDict``; recship.sparse.regroup), the stream interfaces ``Multistreamable`` / ``Pipelineable``
(recship.sparse.streamable), the KJT conversions (``ComputeKJTToJTDict``, ``flatten_kjt_list``,
``validate_keyed_jagged_tensor``, ...; recship.sparse.conversions) and the PT2 checks (recship.sparse.pt2)."""

from recship.sparse.conversions import (ComputeJTDictToKJT, ComputeKJTToJTDict, flatten_kjt_list, maybe_td_to_kjt,
                                        unflatten_kjt_list, validate_keyed_jagged_tensor)
from recship.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor, jt_is_equal, kjt_is_equal
from recship.sparse.pt2 import (is_non_strict_exporting, is_pt2_compiling, is_torchdynamo_compiling, pt2_check_size_nonzero,
                                pt2_checks_all_is_size, pt2_checks_tensor_slice, pt2_guard_or_false, pt2_guard_or_true)
from recship.sparse.regroup import (CacheMixin, DataType, KTRegroupAsDict, PermuteMultiEmbedding, data_type_to_dtype,
                                    is_fx_tracing, module_init, permute_multi_embedding, regroup_kts)
from recship.sparse.streamable import Multistreamable, Pipelineable

import recship.sparse.pytree  # noqa: F401,E402  (registers KeyedJaggedTensor as a pytree node)

__all__ = ["CacheMixin", "ComputeJTDictToKJT", "ComputeKJTToJTDict", "DataType", "JaggedTensor", "KTRegroupAsDict",
           "KeyedJaggedTensor", "KeyedTensor", "Multistreamable", "PermuteMultiEmbedding", "Pipelineable",
           "data_type_to_dtype", "flatten_kjt_list", "is_fx_tracing", "is_non_strict_exporting", "is_pt2_compiling",
           "is_torchdynamo_compiling", "jt_is_equal", "kjt_is_equal", "maybe_td_to_kjt", "module_init",
           "permute_multi_embedding", "pt2_check_size_nonzero", "pt2_checks_all_is_size", "pt2_checks_tensor_slice",
           "pt2_guard_or_false", "pt2_guard_or_true", "regroup_kts", "unflatten_kjt_list", "validate_keyed_jagged_tensor"]
