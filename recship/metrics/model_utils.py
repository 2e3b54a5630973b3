"""Pulling each task's labels, predictions and weights out of a model's output dict (``RecMetricModule.update``).

Each tensor is squeezed: a [B, 1] prediction becomes [B]; a single sample's 0-d tensors become [1]. Labels,
predictions and weights must have as many elements as each other (a multiclass prediction [B, C] goes with [B]
labels; a vector-valued label [B, D] with [B, D] predictions and [B] weights).
"""

import logging
from typing import Dict, List, Optional, Tuple

import torch

from recship.metrics.metrics_config import RecTaskInfo

logger: logging.Logger = logging.getLogger(__name__)


def session_ids_to_tensor(session_ids: List[str], device: Optional[torch.device] = None) -> torch.Tensor:
    """Session ids (runs of equal strings) as 1, 1, 2, 2, 2, 3, ...: each run numbered from 1 in order."""
    numbers, current = [], 1
    for i, session in enumerate(session_ids):
        if i > 0 and session != session_ids[i - 1]:
            current += 1
        numbers.append(current)
    return torch.tensor(numbers, device=device)


def is_empty_signals(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> bool:
    """All three tensors are empty."""
    return torch.numel(labels) <= 0 and torch.numel(predictions) <= 0 and torch.numel(weights) <= 0


def parse_model_outputs(
    label_name: str,
    prediction_name: str,
    weight_name: str,
    model_out: Dict[str, torch.Tensor],
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(labels, predictions, weights) of one task from ``model_out``, squeezed; an empty ``prediction_name``
    (label-only metrics) gives (labels, None, None)."""
    if label_name not in model_out:
        raise ValueError(f"Label name {label_name} not found in model output")
    labels = model_out[label_name].squeeze()
    if not prediction_name:
        if weight_name:
            raise ValueError(f"weight name must be empty if prediction name is empty, got {weight_name!r}")
        return labels, None, None
    if prediction_name not in model_out:
        raise ValueError(f"Prediction name {prediction_name} not found in model output")
    predictions = model_out[prediction_name].squeeze()
    if weight_name not in model_out:
        raise ValueError(f"Weight {weight_name} not found in model output")
    weights = model_out[weight_name].squeeze()
    if is_empty_signals(labels, predictions, weights):
        return labels, predictions, weights
    if labels.dim() == predictions.dim():
        vector_valued = (
            labels.dim() == 2
            and weights.dim() == 1
            and labels.size(0) == predictions.size(0) == weights.size(0)
        )
        if vector_valued:
            logger.warning(
                "Vector valued labels and predictions: labels %s, predictions %s, weights %s",
                tuple(labels.shape), tuple(predictions.shape), tuple(weights.shape),
            )
        elif not torch.numel(labels) == torch.numel(predictions) == torch.numel(weights):
            raise ValueError(
                "Expect the same number of elements in labels, predictions, and weights. Instead got "
                f"{torch.numel(labels)}, {torch.numel(predictions)}, {torch.numel(weights)}"
            )
    elif not (
        torch.numel(labels) * predictions.size(-1) == torch.numel(predictions)
        and torch.numel(labels) == torch.numel(weights)
    ):  # multiclass: labels [B], predictions [B, n_classes]
        raise ValueError(
            f"multiclass outputs: expected labels [B], predictions [B, C], weights [B]; got {tuple(labels.shape)}, "
            f"{tuple(predictions.shape)}, {tuple(weights.shape)}"
        )
    if labels.dim() == 0:
        labels, predictions, weights = labels.unsqueeze(0), predictions.unsqueeze(0), weights.unsqueeze(0)
    return labels, predictions, weights


def parse_required_inputs(
    model_out: Dict[str, torch.Tensor],
    required_inputs_list: List[str],
    ndcg_transform_input: bool = False,
    device: Optional[torch.device] = None,
) -> Dict[str, torch.Tensor]:
    """The extra model outputs a metric needs (grouping keys, session ids), squeezed. With
    ``ndcg_transform_input`` a list of session id strings becomes their run numbers (``session_ids_to_tensor``),
    written back into ``model_out``."""
    required: Dict[str, torch.Tensor] = {}
    for feature in required_inputs_list:
        if feature not in model_out:
            raise ValueError(f"required input {feature!r} not found in model output (keys {sorted(model_out)})")
        if ndcg_transform_input and isinstance(model_out[feature], list):
            model_out[feature] = session_ids_to_tensor(model_out[feature], device=device)  # type: ignore[arg-type]
        required[feature] = model_out[feature].squeeze()
    return required


def parse_task_model_outputs(
    tasks: List[RecTaskInfo],
    model_out: Dict[str, torch.Tensor],
    required_inputs_list: Optional[List[str]] = None,
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor], Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """({task: labels}, {task: predictions}, {task: weights}, {input: tensor}) for every task with a non-empty
    batch (label-only tasks appear in the labels only)."""
    all_labels: Dict[str, torch.Tensor] = {}
    all_predictions: Dict[str, torch.Tensor] = {}
    all_weights: Dict[str, torch.Tensor] = {}
    all_required_inputs: Dict[str, torch.Tensor] = {}
    ndcg_transform_input = False
    labels: Optional[torch.Tensor] = None
    for task in tasks:
        labels, predictions, weights = parse_model_outputs(
            task.label_name, task.prediction_name, task.weight_name, model_out
        )
        if predictions is not None and weights is not None:
            if not is_empty_signals(labels, predictions, weights):
                all_labels[task.name] = labels
                all_predictions[task.name] = predictions
                all_weights[task.name] = weights
        elif torch.numel(labels) > 0:
            all_labels[task.name] = labels
        if task.name and task.name.startswith("ndcg"):
            ndcg_transform_input = True
    if required_inputs_list is not None:
        all_required_inputs = parse_required_inputs(
            model_out, required_inputs_list, ndcg_transform_input, device=None if labels is None else labels.device
        )
    return all_labels, all_predictions, all_weights, all_required_inputs
