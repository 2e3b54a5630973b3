"""A multi-task ranker, ESMM-style: click-through (CTR) and conversion (CVR) towers over shared embeddings, with a
target attention over the user's behaviour sequence; trained on labels [B, 2] (click, click-and-convert), exported
and served with recship.

ESMM (Ma et al., SIGIR 2018) learns pCVR over the whole impression space through pCTCVR = pCTR * pCVR: the CTR
task is trained on clicks, the CTCVR task on click-and-convert, and the CVR tower is never trained on clicked
examples alone (no sample selection bias). Both towers read the same embeddings.

- Features: ``user``, ``item`` (the candidate), ``category`` (the candidate's), pooled by one
  EmbeddingBagCollection; ``history``, the items the user interacted with, looked up unpooled by an
  EmbeddingCollection and pooled here by a DIN-style target attention (a weight per history item from the item
  and the candidate, no softmax: a jagged sum with ``index_add_``, which export traces).
- Outputs (each [B, 1], logits): ``ctr``, ``cvr`` and ``ctcvr`` (the logit of sigmoid(ctr) * sigmoid(cvr)).
- ``loss(outputs, labels [B, 2])``: binary cross-entropy of ``ctr`` on column 0 and of ``ctcvr`` on column 1;
  ``eval_outputs = {"ctr": 0, "ctcvr": 1}``: evaluation reports each task's AUC and log loss.

Run it from the repository root: ``.venv/bin/python examples/esmm.py runs/esmm`` (or the README's commands).
"""

import json
import sys
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from recship import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recship.trainer import EmbeddingCollection, EmbeddingConfig

FEATURES = ["user", "item", "category", "history"]


class ESMM(nn.Module):
    """CTR and CVR towers over shared embeddings and a target attention over ``history``; see the module docstring."""

    eval_output = "ctr"  # the top-level eval metrics, and what export scores
    eval_outputs = {"ctr": 0, "ctcvr": 1}  # output -> label column: each is evaluated on its own

    def __init__(self, users: int = 200, items: int = 500, categories: int = 20, dim: int = 16, hidden: int = 32,
                 device: Optional[str] = None) -> None:
        super().__init__()
        self.num_dense = 2
        self.dim = dim
        self.tables = EmbeddingBagCollection([
            EmbeddingBagConfig(name="user_table", num_embeddings=users, embedding_dim=dim, feature_names=["user"]),
            EmbeddingBagConfig(name="item_table", num_embeddings=items, embedding_dim=dim, feature_names=["item"]),
            EmbeddingBagConfig(name="category_table", num_embeddings=categories, embedding_dim=dim, feature_names=["category"]),
        ], device=device)
        self.history = EmbeddingCollection([
            EmbeddingConfig(name="history_table", num_embeddings=items, embedding_dim=dim, feature_names=["history"]),
        ], device=device)
        self.attention = nn.Sequential(nn.Linear(3 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        width = 4 * dim + self.num_dense
        self.ctr_tower = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.cvr_tower = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        if device != "meta":
            with torch.no_grad():
                for p in self.parameters():
                    if p.dim() == 2:
                        nn.init.normal_(p, 0, 0.1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        pooled = self.tables(features).values()  # [B, 3 * dim]: user, item, category
        target = pooled[:, self.dim : 2 * self.dim]  # the candidate item, [B, dim]
        history = self.history(features)["history"]  # jagged: [N, dim] for N history items in the batch
        lengths = history.lengths()
        example = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        items = history.values()
        candidate = target.index_select(0, example)
        weight = self.attention(torch.cat([items, candidate, items * candidate], dim=1))  # [N, 1]
        interest = torch.zeros_like(target).index_add_(0, example, weight * items)  # [B, dim], 0 for no history
        x = torch.cat([pooled, interest, dense], dim=1)
        ctr, cvr = self.ctr_tower(x), self.cvr_tower(x)
        log_ctcvr = nn.functional.logsigmoid(ctr) + nn.functional.logsigmoid(cvr)  # log(pCTR * pCVR)
        ctcvr = log_ctcvr - torch.log(-torch.expm1(log_ctcvr.clamp(max=-1e-6)))  # its logit
        return {"ctr": ctr, "cvr": cvr, "ctcvr": ctcvr}

    def loss(self, outputs: Dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """labels [B, 2]: click, click-and-convert."""
        bce = nn.functional.binary_cross_entropy_with_logits
        return bce(outputs["ctr"].view(-1), labels[:, 0]) + bce(outputs["ctcvr"].view(-1), labels[:, 1])


def build(users: int = 200, items: int = 500, categories: int = 20, dim: int = 16, hidden: int = 32,
          device: Optional[str] = None) -> ESMM:
    """The entry point: ``--model examples.esmm:build --model-args '{"items": 500}'``."""
    return ESMM(users, items, categories, dim, hidden, device)


# -- data: impressions with clicks and conversions from a fixed hidden model ---------------------------------------


class _World:
    """The hidden model: per-user and per-item click propensities, per-item conversion, item categories; a
    candidate whose category the user's history shares is clicked more."""

    def __init__(self, users: int = 200, items: int = 500, categories: int = 20) -> None:
        g = torch.Generator().manual_seed(20180708)
        self.users, self.items = users, items
        self.user_click = torch.randn(users, generator=g) * 0.5
        self.item_click = torch.randn(items, generator=g)
        self.item_convert = torch.randn(items, generator=g)
        self.category = torch.randint(0, categories, (items,), generator=g)


def _impressions(batch_size: int, rank: int, world_size: int, stream: int, batches: int
                 ) -> Iterator[Tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
    """This rank's share (batches i with i % world_size == rank) of ``batches`` batches of stream ``stream``."""
    w = _World()
    for i in range(rank, batches, world_size):
        g = torch.Generator().manual_seed(stream * 1_000_003 + i)
        B = batch_size
        user = torch.randint(0, w.users, (B,), generator=g)
        item = torch.randint(0, w.items, (B,), generator=g)
        lengths = torch.randint(0, 6, (B,), generator=g)
        history = torch.randint(0, w.items, (int(lengths.sum()),), generator=g)
        example = torch.repeat_interleave(torch.arange(B), lengths)
        same = torch.zeros(B).index_add_(0, example, (w.category[history] == w.category[item][example]).float())
        dense = torch.rand(B, 2, generator=g)
        click_logit = w.user_click[user] + w.item_click[item] + 1.5 * same / lengths.clamp(min=1) + dense[:, 0] - 1.0
        click = torch.rand(B, generator=g) < torch.sigmoid(click_logit)
        convert = torch.rand(B, generator=g) < torch.sigmoid(w.item_convert[item] + 2.0 * dense[:, 1] - 1.0)
        features = KeyedJaggedTensor(keys=FEATURES, values=torch.cat([user, item, w.category[item], history]),
                                     lengths=torch.cat([torch.ones(3 * B, dtype=torch.int64), lengths]).to(torch.int32))
        yield dense, features, torch.stack([click, click & convert], dim=1).float()


def data(batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[Tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
    """Training impressions: ``--data examples.esmm:data``; 64 batches a pass, labels [B, 2]."""
    return _impressions(batch_size, rank, world_size, stream=1, batches=64)


def eval_data(batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[Tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
    """Held-out impressions: ``--eval-data examples.esmm:eval_data``; 16 batches, labels [B, 2]."""
    return _impressions(batch_size, rank, world_size, stream=2, batches=16)


def main(out: str) -> Dict[str, list]:
    """Trains 60 steps, resumes to 80 (the checkpoint's data and batch size, not given again), exports to INT8 into
    a model repository (validated on the run's eval data), serves it and asks for one prediction."""
    from recship.cli import main as recship
    from recship.serving import PredictClient
    from recship.serving.server import Server, ServerConfig

    run, repo = Path(out) / "run", Path(out) / "repo"
    quiet = ["--no-progress", "--no-plot"]
    assert recship(["train", "--out", str(run), "--model", "examples.esmm:build", "--data", "examples.esmm:data",
                    "--eval-data", "examples.esmm:eval_data", "--batch-size", "64", "--steps", "60", "--eval-every", "30",
                    "--overwrite", *quiet]) == 0
    assert recship(["train", "--out", str(run), "--resume", "--steps", "80", *quiet]) == 0
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    assert recship(["export", str(checkpoint), "--out", str(repo / "esmm" / "1"), "--model-name", "esmm", "--overwrite"]) == 0
    server = Server(ServerConfig(model_repo=str(repo), port=0))
    try:
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            answer = client.predict("esmm", {"user": [[7]], "item": [[42]], "category": [[3]], "history": [[42, 17, 260]]},
                                    dense=[[0.5, 0.25]])
    finally:
        server.stop()
    print(json.dumps({k: v.tolist() for k, v in answer.items()}))
    return {k: v.tolist() for k, v in answer.items()}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/esmm")
