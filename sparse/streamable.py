"""TorchRec's stream interfaces (``torchrec.streamable``): ``Multistreamable`` (``record_stream``) and
``Pipelineable`` (``record_stream`` and ``to``), what a train pipeline needs of a batch to copy it to the device on
a side stream. JaggedTensor, KeyedJaggedTensor and KeyedTensor are registered as Pipelineable (virtual subclasses:
``isinstance`` holds, their classes are unchanged), and so is torch.Tensor; a user's batch class subclasses
Pipelineable and implements both methods.
"""

import abc

import torch

from recship.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor


class Multistreamable(abc.ABC):
    """An object whose tensors can be used on another CUDA stream: ``record_stream(stream)`` marks them as used
    there (see ``torch.Tensor.record_stream``)."""

    @abc.abstractmethod
    def record_stream(self, stream: torch.Stream) -> None: ...


class Pipelineable(Multistreamable):
    """A Multistreamable that moves across devices: ``to(device, non_blocking)`` returns the moved object (self or
    a copy: assign the result)."""

    @abc.abstractmethod
    def to(self, device: torch.device, non_blocking: bool) -> "Pipelineable": ...


for _cls in (torch.Tensor, JaggedTensor, KeyedJaggedTensor, KeyedTensor):
    Pipelineable.register(_cls)

__all__ = ["Multistreamable", "Pipelineable"]
