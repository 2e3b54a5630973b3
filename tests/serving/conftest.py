"""One small DLRM artifact for the serving tests that need a real model (built once per session)."""

import pytest
import torch

from recship.export import ExportConfig, export_model
from recship.trainer.dlrm import DLRM, DLRMConfig
from serving_helpers import ROWS


@pytest.fixture(scope="session")
def small_artifact(tmp_path_factory):
    """Path of an INT8 artifact of a small 26-feature DLRM (dense 13, outputs logit and prob [B, 1])."""
    torch.manual_seed(0)
    model = DLRM(DLRMConfig(num_embeddings_per_feature=ROWS, embedding_dim=8, dense_arch=[16], over_arch=[16]))
    out = tmp_path_factory.mktemp("artifact") / "dlrm"
    export_model(model, ExportConfig(out=str(out), dtype="int8", progress=False, validation_batches=1, batch_size_hint=32))
    return out
