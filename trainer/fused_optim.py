"""Optimizers fused into the embedding backward (fbgemm TBE): their names and settings.

The update happens inside ``backward()``; no embedding gradient is materialised.
On CPU fbgemm implements only EXACT_SGD, EXACT_ADAGRAD and EXACT_ROWWISE_ADAGRAD;
the others need CUDA and are refused at construction on CPU.
"""

from dataclasses import dataclass
from enum import Enum, unique


@unique
class EmbOptimType(Enum):
    EXACT_SGD = "exact_sgd"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_rowwise_adagrad"
    ADAM = "adam"
    PARTIAL_ROWWISE_ADAM = "partial_rowwise_adam"
    LAMB = "lamb"

    @property
    def cpu_supported(self) -> bool:
        return self in _CPU_OPTIMIZERS

    def state_floats(self, rows: int, cols: int) -> int:
        """fp32 optimizer-state elements for a [rows, cols] shard."""
        if self is EmbOptimType.EXACT_SGD:
            return 0
        if self is EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            return rows  # one running mean of g^2 per row
        if self is EmbOptimType.EXACT_ADAGRAD:
            return rows * cols
        if self is EmbOptimType.PARTIAL_ROWWISE_ADAM:
            return rows * cols + rows  # full first moment, row-wise second moment
        return 2 * rows * cols  # ADAM, LAMB: two full moments


_CPU_OPTIMIZERS = (
    EmbOptimType.EXACT_SGD,
    EmbOptimType.EXACT_ADAGRAD,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD,
)


@dataclass
class FusedOptimizerConfig:
    """Settings of the fused embedding optimizer (shared by every table).

    Args:
        optimizer: which update rule.
        learning_rate: step size; change it between steps with
            ``FusedOptimizer.set_learning_rate``.
        eps: added to the denominator (adagrad, adam, lamb).
        weight_decay: L2 weight decay (CUDA only: fbgemm's CPU kernels ignore it, so
            it is refused on CPU).
        beta1, beta2: moment decay (adam, partial-rowwise adam, lamb).
    """

    optimizer: EmbOptimType = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    learning_rate: float = 0.01
    eps: float = 1.0e-8
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, EmbOptimType):
            raise TypeError(f"optimizer must be an EmbOptimType, got {self.optimizer!r}")
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")

    def check_device(self, device_type: str) -> None:
        """Raises ValueError if this optimizer cannot run on ``device_type``."""
        if device_type == "cpu" and not self.optimizer.cpu_supported:
            supported = ", ".join(o.name for o in _CPU_OPTIMIZERS)
            raise ValueError(
                f"fused optimizer {self.optimizer.name} runs on CUDA only (fbgemm has no CPU "
                f"kernel for it); on CPU use one of {supported}"
            )
        if device_type == "cpu" and self.weight_decay != 0:
            # fbgemm-gpu-cpu 1.8.0 accepts weight_decay on CPU but its kernels ignore it
            # (checked for every CPU optimizer, L2 and decoupled): refuse, don't train silently without it.
            raise ValueError(
                f"weight_decay={self.weight_decay} is not applied by fbgemm's CPU kernels; "
                "use weight_decay=0 on CPU (it is honoured on CUDA)"
            )
