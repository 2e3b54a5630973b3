"""Bring your own model: a small ranking model in its own file, trained, exported and served with recship.

The model contract (``recship.export.any_model``):
- ``forward(dense, features)``: ``dense`` float32 [B, num_dense] (num_dense may be 0),
  ``features`` a KeyedJaggedTensor of the sparse features;
- returns a Tensor [B, ...] or a Dict[str, Tensor] of [B, ...] tensors;
- EmbeddingBagCollections / EmbeddingCollections anywhere inside; a ``num_dense`` attribute;
- a forward that torch.fx can trace (no Python branches on tensor values); transforms of
  raw inputs (here log1p of counts, modulo of ids) belong inside it;
- optional: ``loss(outputs, labels)`` and ``eval_output`` for training (else binary
  cross-entropy on the single output); a ``device`` argument so recship can build it on "meta".

Run it from the repository root: ``.venv/bin/python examples/my_model.py runs/my_model``
(or use the commands in the README's "Bring your own model" section with
``--model examples.my_model:build``).
"""

import json
import sys
from pathlib import Path
from typing import Dict, Optional

import torch
from torch import nn

from recship import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor


class MyRanker(nn.Module):
    """Watch-time ranker: a video id and a channel id, plus 3 dense counts; outputs ``logit`` [B, 1]."""

    def __init__(self, videos: int = 1000, channels: int = 100, dim: int = 16, device: Optional[str] = None) -> None:
        super().__init__()
        self.num_dense = 3
        self.tables = EmbeddingBagCollection([
            EmbeddingBagConfig(name="video_table", num_embeddings=videos, embedding_dim=dim, feature_names=["video"]),
            EmbeddingBagConfig(name="channel_table", num_embeddings=channels, embedding_dim=dim, feature_names=["channel"]),
        ], device=device)
        self.mlp = nn.Sequential(nn.Linear(2 * dim + 3, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.tables(features).values()
        return self.mlp(torch.cat([pooled, torch.log1p(dense.clamp(min=0))], dim=1))


def build(videos: int = 1000, channels: int = 100, dim: int = 16, device: Optional[str] = None) -> MyRanker:
    """The entry point: ``--model examples.my_model:build --model-args '{"videos": 1000}'``."""
    return MyRanker(videos, channels, dim, device)


def main(out: str) -> Dict[str, list]:
    """Trains 50 steps, exports to INT8 into a model repository, serves it and asks for one prediction."""
    from recship.cli import main as recship
    from recship.serving import PredictClient
    from recship.serving.server import Server, ServerConfig

    run, repo = Path(out) / "run", Path(out) / "repo"
    args = ["--model", "examples.my_model:build", "--model-args", json.dumps({"videos": 500, "channels": 50})]
    assert recship(["train", "--out", str(run), "--steps", "50", "--overwrite", "--no-progress", *args]) == 0
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    assert recship(["export", str(checkpoint), "--out", str(repo / "my_model" / "1"), "--model-name", "my_model", "--overwrite"]) == 0
    server = Server(ServerConfig(model_repo=str(repo), port=0))
    try:
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            answer = client.predict("my_model", {"video": [[3, 17]], "channel": [[5]]}, dense=[[2.0, 0.0, 7.0]])
    finally:
        server.stop()
    print({k: v.tolist() for k, v in answer.items()})
    return {k: v.tolist() for k, v in answer.items()}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/my_model")
