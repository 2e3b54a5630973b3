"""gRPC prediction server for exported recship artifacts, and its Python client.

The generated protobuf stubs live in ``recship.serving.v1`` (built from protos/).
"""

from recship.serving.client import PredictClient

__all__ = ["PredictClient"]
