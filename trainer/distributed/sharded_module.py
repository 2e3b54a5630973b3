"""The rest of TorchRec's ``torchrec.distributed.types`` vocabulary: the sharded-module base class and its contexts,
the awaitables built on LazyAwaitable, communication codecs and the small enums and helpers user code names.

recship's sharded modules derive from ``ShardedModule`` (so ``isinstance(m, ShardedModule)`` finds them as in
TorchRec) and run their three stages inside ``forward``; the contexts exist for code that creates or passes them.
"""

import abc
from dataclasses import dataclass, field
from enum import Enum, unique
from typing import Any, Dict, Generic, Iterator, List, Optional, TypeVar

import torch
from torch import nn

from recship.trainer.distributed.types import LazyAwaitable
from recship.sparse import KeyedJaggedTensor

W = TypeVar("W")
KT = TypeVar("KT")
VT_co = TypeVar("VT_co")
ParentW = TypeVar("ParentW")
QuantizationContext = TypeVar("QuantizationContext")


class ShardedModuleContext(abc.ABC):
    """What a sharded module carries from its input distribution to its output (TorchRec's base)."""

    @abc.abstractmethod
    def record_stream(self, stream: torch.Stream) -> None:
        """Marks the context's tensors as used on ``stream`` (CUDA streams; nothing to do on CPU)."""


class NullShardedModuleContext(ShardedModuleContext):
    """A context that holds nothing."""

    def record_stream(self, stream: torch.Stream) -> None:
        pass


class NullShardingContext:
    """A sharding's context that holds nothing (TorchRec's ``Multistreamable`` with no tensors)."""

    def record_stream(self, stream: torch.Stream) -> None:
        pass


class ShardedModule(abc.ABC, nn.Module):
    """The base of sharded modules: recship's ShardedEmbeddingBagCollection and the others derive from it.

    TorchRec splits a sharded module's forward into ``input_dist`` -> ``compute`` -> ``output_dist``, each returning
    an awaitable; recship's run all three inside ``forward`` and return a completed LazyAwaitable. A subclass
    implements ``forward``; ``sharded_parameter_names`` lists its sharded parameters' names.

    Args:
        qcomm_codecs_registry: TorchRec's quantized-communication codecs; recship's collectives send fp32, so
            anything but None is refused.
    """

    def __init__(self, qcomm_codecs_registry: Optional[Dict[str, "QuantizedCommCodecs"]] = None) -> None:
        super().__init__()
        if qcomm_codecs_registry:
            raise ValueError(f"qcomm_codecs_registry={qcomm_codecs_registry!r}: recship's all-to-alls send fp32 "
                             "(no quantized communication): leave it out")
        self._qcomm_codecs_registry = qcomm_codecs_registry

    @property
    def qcomm_codecs_registry(self) -> Optional[Dict[str, "QuantizedCommCodecs"]]:
        return self._qcomm_codecs_registry

    def create_context(self) -> ShardedModuleContext:
        return NullShardedModuleContext()

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """The names of this module's parameters that are sharded (here: all of its own)."""
        for name, _ in self.named_parameters(prefix=prefix):
            yield name


class LazyNoWait(LazyAwaitable[W]):
    """A LazyAwaitable of an object already at hand (TorchRec's; recship's NoWait is the same with its result set)."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


class LazyGetItemMixin(Generic[KT, VT_co]):
    """Makes ``awaitable[key]`` another awaitable instead of waiting (put it before LazyAwaitable in the bases)."""

    def __getitem__(self, key: KT) -> "GetItemLazyAwaitable":
        return GetItemLazyAwaitable(self, key)  # type: ignore[arg-type]


class GetItemLazyAwaitable(LazyAwaitable[W], Generic[W, ParentW, KT]):
    """``parent[key]``, computed when waited: waits for ``parent`` and indexes its result."""

    def __init__(self, parent: LazyAwaitable[ParentW], key: KT) -> None:
        super().__init__()
        self._parent = parent
        self._key = key

    def _wait_impl(self) -> W:
        return self._parent.wait()[self._key]  # type: ignore[index]


class DeviceToHostTensorAwaitable(LazyAwaitable[torch.Tensor]):
    """A tensor copied to the host: on CUDA the copy is asynchronous and ``wait`` synchronises with it; on the CPU
    the tensor is already there."""

    def __init__(self, tensor_on_device: torch.Tensor) -> None:
        super().__init__()
        self._tensor = tensor_on_device.to("cpu", non_blocking=tensor_on_device.is_cuda)
        self._event = None
        if tensor_on_device.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def _wait_impl(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._tensor


class ModuleNoCopyMixin:
    """A module that ``copy.deepcopy`` and ``copy_to_device`` keep as the same object (TorchRec's: for modules
    whose state must not be duplicated)."""

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ModuleNoCopyMixin":
        return self

    def copy(self, device: torch.device) -> nn.Module:  # noqa: ARG002 - TorchRec's signature
        return self  # type: ignore[return-value]


class GenericMeta(type):
    """TorchRec's metaclass for generic sharded types (kept for code that names it)."""


# -- communication -------------------------------------------------------------------------------------------------


class QuantizedCommCodec(Generic[QuantizationContext]):
    """TorchRec's interface of a codec that compresses a collective's tensors (encode before, decode after)."""

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[QuantizationContext] = None) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, input_grad: torch.Tensor, ctx: Optional[QuantizationContext] = None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def quantized_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def calc_quantized_size(self, input_len: int, ctx: Optional[QuantizationContext] = None) -> int:
        raise NotImplementedError

    def create_context(self) -> Optional[QuantizationContext]:
        raise NotImplementedError

    def padded_size(self, input_tensor: torch.Tensor, dim_per_rank: List[int], my_rank: int,
                    qcomm_ctx: QuantizationContext) -> "tuple":
        raise NotImplementedError


class NoOpQuantizedCommCodec(QuantizedCommCodec[None]):
    """The codec that leaves tensors as they are (fp32): the only one recship's collectives use."""

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[None] = None) -> torch.Tensor:
        return input_tensor

    def decode(self, input_grad: torch.Tensor, ctx: Optional[None] = None) -> torch.Tensor:
        return input_grad

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.float

    def calc_quantized_size(self, input_len: int, ctx: Optional[None] = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def padded_size(self, input_tensor: torch.Tensor, dim_per_rank: List[int], my_rank: int, qcomm_ctx: None) -> "tuple":
        return input_tensor, dim_per_rank[my_rank]


@dataclass
class QuantizedCommCodecs:
    """The codecs of one collective: ``forward`` for its output, ``backward`` for its gradient."""

    forward: QuantizedCommCodec = field(default_factory=NoOpQuantizedCommCodec)
    backward: QuantizedCommCodec = field(default_factory=NoOpQuantizedCommCodec)


@unique
class CommOp(Enum):
    """The collectives TorchRec's codec registry is keyed by."""

    POOLED_EMBEDDINGS_ALL_TO_ALL = "pooled_embeddings_all_to_all"
    POOLED_EMBEDDINGS_REDUCE_SCATTER = "pooled_embeddings_reduce_scatter"
    SEQUENCE_EMBEDDINGS_ALL_TO_ALL = "sequence_embeddings_all_to_all"


@unique
class EmbeddingEvent(Enum):
    """The stages of a sharded lookup TorchRec's profiler annotations name."""

    KJT_SPLITS_DIST = "splits_dist"
    KJT_TENSORS_DIST = "tensors_dist"
    LOOKUP = "lookup"
    OUTPUT_DIST = "output_dist"
    OUTPUT_DIST_WAIT = "output_dist_wait"


def rank_device(device_type: str, rank: int) -> torch.device:
    """The device of ``rank``: the CPU for "cpu", else ``<device_type>:<rank>``."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(f"{device_type}:{rank}")


def get_tensor_size_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (numel x element size)."""
    return t.numel() * t.element_size()


# -- TorchRec's torchrec.distributed.fbgemm_qcomm_codec -------------------------------------------------------------


@unique
class CommType(Enum):
    """The precisions TorchRec's quantized communication can send."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    MX4 = "mx4"


@dataclass
class QCommsConfig:
    """TorchRec's quantized-communication settings of the embedding all-to-alls (forward and backward precision).
    recship's collectives send fp32: only ``CommType.FP32`` both ways has codecs (none needed)."""

    forward_precision: CommType = CommType.FP32
    backward_precision: CommType = CommType.FP32
    forward_loss_scale: Optional[float] = None
    backward_loss_scale: Optional[float] = None
    fp8_quantize_dim: Optional[int] = None
    fp8_quantize_dim_bwd: Optional[int] = None
    fp8_bwd_uses_143: Optional[bool] = False
    mx4_quantize_dim: Optional[int] = None
    mx4_quantize_dim_bwd: Optional[int] = None
    mx4_rounding_mode: Optional[Any] = None


def _check_fp32(qcomms_config: Optional[QCommsConfig]) -> None:
    if qcomms_config is None:
        return
    other = {k: p for k, p in (("forward_precision", qcomms_config.forward_precision),
                               ("backward_precision", qcomms_config.backward_precision)) if p is not CommType.FP32}
    if other:
        raise ValueError(f"QCommsConfig({', '.join(f'{k}={v}' for k, v in other.items())}): recship's all-to-alls send "
                         "fp32 (no quantized communication); use CommType.FP32 or pass no codecs")


def get_qcomm_codecs(qcomms_config: Optional[QCommsConfig]) -> QuantizedCommCodecs:
    """The codecs of ``qcomms_config``: fp32 both ways (no-op codecs); another precision is refused."""
    _check_fp32(qcomms_config)
    return QuantizedCommCodecs()


def get_qcomm_codecs_registry(qcomms_config: QCommsConfig, comm_ops: Optional[List[CommOp]] = None,
                              device: Optional[torch.device] = None) -> Optional[Dict[str, QuantizedCommCodecs]]:
    """TorchRec's codec registry for the sharders: None for fp32 both ways (as TorchRec); another precision is
    refused (recship sends fp32), rather than silently sent uncompressed."""
    _check_fp32(qcomms_config)
    return None


class ShardedEmbeddingModule(ShardedModule):
    """TorchRec's base of the model-parallel embedding modules (recship's ShardedEmbeddingBagCollection and
    ShardedEmbeddingCollection derive from it): inputs and outputs are data-parallel, the tables sharded."""


# -- torchrec.distributed.embedding's index dedup switch --------------------------------------------------------------

EC_INDEX_DEDUP: bool = False


def set_ec_index_dedup(val: bool) -> None:
    """TorchRec's (deprecated) global switch to dedup an EmbeddingCollection's ids before the all-to-all. The numbers
    are the same either way; recship sends every id, and records the value for ``get_ec_index_dedup``."""
    global EC_INDEX_DEDUP
    EC_INDEX_DEDUP = bool(val)


def get_ec_index_dedup() -> bool:
    return EC_INDEX_DEDUP


def pad_vbe_kjt_lengths(features: Any) -> Any:
    """A variable-batch KeyedJaggedTensor with every key's lengths padded by zeros to the largest batch (its stride),
    so that it is an ordinary KJT of batch ``max(stride_per_key())``; the values and weights are unchanged."""
    strides = features.stride_per_key()
    stride = max(strides) if strides else 0
    lengths = features.lengths()
    padded = torch.zeros(stride * len(features.keys()), dtype=lengths.dtype, device=lengths.device)
    start = 0
    for i, n in enumerate(strides):
        padded[i * stride:i * stride + n] = lengths[start:start + n]
        start += n
    return KeyedJaggedTensor(keys=features.keys(), values=features.values(), weights=features.weights_or_none(),
                             lengths=padded, stride=stride)
