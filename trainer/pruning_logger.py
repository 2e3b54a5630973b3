"""The logging hook of TorchRec's embedding pruning (torchrec.modules.pruning_logger).

A pruning step opens ``SomeLogger.pruning_logger(event, trainer=..., publisher=...)`` as a context manager and sets
attributes on the object it yields (counts, sizes); a logger subclass decides where they go when the block ends.
``PruningLoggerDefault`` yields an empty namespace and records nothing. recship has no in-training pruning
(TorchRec's ITEP needs fbgemm kernels that are not in fbgemm_gpu 1.8.0), so these are for user code that
implements one against this interface.

Example::

    class PrintingLogger(PruningLogger):
        @classmethod
        @contextmanager
        def pruning_logger(cls, event, trainer=None, publisher=None):
            details = SimpleNamespace()
            yield details
            print(event, vars(details))

    with PrintingLogger.pruning_logger("PRUNE") as details:
        details.rows_pruned = 12   # printed on leaving the block
"""

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Generator, Optional


@dataclass
class PruningLogBase:
    """Base of the records a pruning logger may define (no fields of its own)."""


class PruningLogger(ABC):
    """Where pruning events go: ``pruning_logger(event, trainer, publisher)`` is a context manager yielding the
    object the caller fills in."""

    @classmethod
    @abstractmethod
    @contextmanager
    def pruning_logger(cls, event: str, trainer: Optional[str] = None,
                       publisher: Optional[str] = None) -> Generator[object, None, None]:
        yield SimpleNamespace()  # pragma: no cover - abstract


class PruningLoggerDefault(PruningLogger):
    """Records nothing: yields an empty SimpleNamespace."""

    @classmethod
    @contextmanager
    def pruning_logger(cls, event: str, trainer: Optional[str] = None,
                       publisher: Optional[str] = None) -> Generator[object, None, None]:
        yield SimpleNamespace()


__all__ = ["PruningLogBase", "PruningLogger", "PruningLoggerDefault"]
