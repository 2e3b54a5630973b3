"""What recship's two gRPC fronts (Predictor, KServe v2) share: the core's error kinds as gRPC
status codes, request bytes decoded into messages, and method registration.

Like text-generation-inference's interceptor: one table turns what went wrong into a gRPC
status (bad input -> INVALID_ARGUMENT, ..., our bugs -> INTERNAL).
"""

import asyncio
from typing import Any, Awaitable, Callable, Dict, TypeVar

import grpc
from google.protobuf.message import DecodeError

from recship.serving.inference import ErrorKind, Inference, Outcome, error_of
from recship.serving.requests import InvalidRequest

T = TypeVar("T")

CODES = {kind: grpc.StatusCode[kind.label] for kind in ErrorKind}  # the serving rules' status of each kind


def decode(message_class: Any, data: bytes) -> Any:
    """Parses a request message; bytes that do not decode are invalid (INVALID_ARGUMENT, not gRPC's UNKNOWN)."""
    try:
        return message_class.FromString(data)
    except (DecodeError, RecursionError) as e:
        raise InvalidRequest(f"the request is not a valid {message_class.DESCRIPTOR.full_name}: {e}") from None


async def answer(inference: Inference, context: grpc.aio.ServicerContext, method: str, work: Callable[[Outcome], Awaitable[T]]) -> T:
    """``inference.call(method, work)``: its response, or an abort with the status of its error."""
    try:
        return await inference.call(method, work)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        error = e
    kind, message = error_of(error)
    await context.abort(CODES[kind], message)
    raise AssertionError("context.abort raises")  # never reached: abort ends the call by raising


def register(server: grpc.aio.Server, service: str, servicer: Any, responses: Dict[str, Any]) -> None:
    """Registers ``servicer``'s methods (by name, each answering its response class) on a grpc.aio server.

    The methods take the request's bytes, so each decodes them itself (``decode``) and
    undecodable bytes are answered and counted like any other invalid request.
    """
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name), response_serializer=response.SerializeToString)
        for name, response in responses.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
