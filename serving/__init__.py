"""gRPC prediction server for exported recship artifacts, and its Python client.

The generated protobuf stubs live in ``recship.serving.v1`` (built from protos/).
``PredictClient`` is loaded on first use, so ``recship serve --help`` imports neither grpc nor numpy.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recship.serving.client import PredictClient

__all__ = ["PredictClient"]


def __getattr__(name: str) -> Any:
    if name == "PredictClient":
        from recship.serving.client import PredictClient

        return PredictClient
    raise AttributeError(f"module 'recship.serving' has no attribute {name!r}")
