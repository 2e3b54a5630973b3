"""The serving rules both fronts obey, from their one definition: protos/recship/serving/v1/serving_rules.json.

serving/codegen.py generates ``recship.serving.v1.serving_rules`` from it (at build time, like the gRPC stubs;
never committed) and cpp_loader/CMakeLists.txt generates the C++ front's ``recship/serving_rules.h``. This module
gives the Python side its typed view:

- ``LIMITS``: the batching and admission settings (max_batch_size, max_delay_ms, max_queue, max_message_bytes,
  max_inflight_bytes): default, bounds, unit, and the refusal a request past it gets (``violation``);
- ``STATUSES``: each error kind's gRPC status name and HTTP status;
- ``REFUSALS``: the refusals a front makes itself, each an error kind and a ``str.format`` message template;
- the sampled log's interval and kinds per source, the statistics' buckets and the labels of a request that reached
  no version, a request's tensor copies.

tests/serving/test_serving_conformance.py checks both fronts against these rules.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from recship.serving.v1.serving_rules import RULES


@dataclass(frozen=True)
class Limit:
    """A batching or admission setting: its ``default``, its range [lo, hi] (an int if ``integer``), its ``unit``, what
    it is for (``help``: its flag's sentence) and the refusal a request past it gets (``violation``, a REFUSALS key)."""

    name: str
    default: Any
    lo: float
    hi: float
    integer: bool
    unit: str
    help: str
    violation: Optional[str]


@dataclass(frozen=True)
class Refusal:
    """A refusal a front makes itself: its error kind (an ``ErrorKind`` name) and its message template."""

    kind: str
    message: str

    def say(self, **fields: Any) -> str:
        """The message, its ``{name}`` fields filled in."""
        return self.message.format(**fields)


def _limit(name: str, rule: Dict[str, Any]) -> Limit:
    integer = bool(rule.get("integer", False))
    number = int if integer else float
    return Limit(name, number(rule["default"]), rule["min"], rule.get("max", math.inf), integer, rule["unit"], rule["help"],
                 rule.get("violation"))


LIMITS: Dict[str, Limit] = {name: _limit(name, rule) for name, rule in RULES["settings"].items()}
DEFAULT_MAX_BATCH_SIZE: int = LIMITS["max_batch_size"].default
DEFAULT_MAX_QUEUE: int = LIMITS["max_queue"].default
STATUSES: Dict[str, Tuple[str, int]] = {kind: (s["grpc"], s["http"]) for kind, s in RULES["error_kinds"].items()}
REFUSALS: Dict[str, Refusal] = {key: Refusal(r["kind"], r["message"]) for key, r in RULES["refusals"].items()}
BATCH_TOO_LARGE, TOO_LARGE = REFUSALS["batch_too_large"], REFUSALS["too_large"]
QUEUE_FULL, OVERLOADED = REFUSALS["queue_full"], REFUSALS["overloaded"]
DEADLINE, CANCELLED, INTERNAL = REFUSALS["deadline"], REFUSALS["cancelled"], REFUSALS["internal"]
LOG_INTERVAL_S: float = float(RULES["sampled_log"]["interval_s"])  # a source's kind of line: at most one this often
LOG_MAX_KINDS: int = RULES["sampled_log"]["max_kinds"]  # kinds of message counted apart per source; the rest share one
LATENCY_BUCKETS: Tuple[float, ...] = tuple(RULES["statistics"]["latency_buckets_s"])  # seconds: latency, queue, compute
BATCH_BUCKETS: Tuple[int, ...] = tuple(RULES["statistics"]["batch_buckets"])  # examples per forward
UNROUTED: str = RULES["statistics"]["unrouted_label"]  # the model and version labels of a request that reached no version
TENSOR_COPIES: int = RULES["tensor_copies"]  # a request's in-flight cost: its bytes + this many times its decoded tensors
