"""Evaluation metrics of a binary classifier (trainer and exporter report them)."""

import torch


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half)."""
    pos = int(labels.sum())
    neg = labels.numel() - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # average the ranks of tied scores
    unique, inverse, counts = torch.unique(sorted_scores, return_inverse=True, return_counts=True)
    if unique.numel() < scores.numel():
        rank_sum = torch.zeros(unique.numel(), dtype=torch.float64).index_add_(0, inverse, ranks[order])
        ranks[order] = (rank_sum / counts)[inverse]
    return float((ranks[labels > 0.5].sum() - pos * (pos + 1) / 2) / (pos * neg))
