"""Example models that follow recship's model contract (see ``recship.export.any_model``).

``forward(dense, features)``: dense float32 [B, num_dense], features a KeyedJaggedTensor;
returns a Tensor or a Dict[str, Tensor], batch first. Each is exported, served and run
from C++ by the tests exactly as a user's own model would be.
"""

from recship.models.ranker import MultiTaskRanker
from recship.models.two_tower import TwoTower

__all__ = ["MultiTaskRanker", "TwoTower"]
