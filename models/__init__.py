"""Example models that follow recship's model contract (see ``recship.export.any_model``), and TorchRec's models.

``forward(dense, features)``: dense float32 [B, num_dense], features a KeyedJaggedTensor;
returns a Tensor or a Dict[str, Tensor], batch first. Each is exported, served and run
from C++ by the tests exactly as a user's own model would be.

``dlrm`` (``recship.models.dlrm``) holds TorchRec's DLRM family (``torchrec.models.dlrm``: ``dlrm.DLRM``,
``dlrm.DLRM_DCN``, ...) and the built-in DLRM (``dlrm.BuiltinDLRM``, built by the entry point ``recship.models.dlrm:builtin``).
``deepfm`` (``recship.models.deepfm``) holds TorchRec's ``torchrec.models.deepfm`` (``SimpleDeepFMNN`` and its archs).
``layers`` holds TorchRec's ``torchrec.modules.mlp`` / ``crossnet`` / ``activation`` / ``deepfm``.
"""

from recship.models import deepfm, dlrm, layers
from recship.models.ranker import MixedRanker, MultiTaskRanker
from recship.models.two_tower import TwoTower

__all__ = ["MixedRanker", "MultiTaskRanker", "TwoTower", "deepfm", "dlrm", "layers"]
