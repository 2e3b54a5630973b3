"""gRPC prediction server for exported recship artifacts, and its Python client.

The generated protobuf stubs live in ``recship.serving.v1`` (built from protos/). Names load on
first use, so ``recship serve --help`` imports neither grpc nor numpy, and ``PredictClient`` no torch.
"""

from typing import TYPE_CHECKING

from recship.lazy import lazy_names

_NAMES = {
    "PredictClient": "recship.serving.client",
    "Server": "recship.serving.server",
    "ServerConfig": "recship.serving.settings",
}

__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_names(__name__, _NAMES, globals())

if TYPE_CHECKING:  # what __getattr__ returns, for type checkers
    from recship.serving.client import PredictClient as PredictClient
    from recship.serving.server import Server as Server
    from recship.serving.settings import ServerConfig as ServerConfig
