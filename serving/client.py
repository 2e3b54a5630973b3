"""PredictClient: a small Python client for the Predictor service.

    client = PredictClient("127.0.0.1:8500")
    out = client.predict("dlrm", {"cat_0": [[1, 2], [3]], ...}, dense=[[...], [...]])   # {"prob": array [2, 1], ...}
"""

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from recship.serving.v1 import predictor_pb2 as pb
from recship.serving.v1 import predictor_pb2_grpc as pb_grpc
from recship.serving.values import number_error, shown

if TYPE_CHECKING:  # the client itself does not need torch
    from recship.sparse import KeyedJaggedTensor

Sparse = Union[Mapping[str, Sequence[Sequence[int]]], "KeyedJaggedTensor"]
Dense = Union[np.ndarray, Sequence[Sequence[float]]]  # [B, num_dense]
Weights = Mapping[str, Sequence[Sequence[float]]]


# A Predict the server cancelled is sent again (once): a gRPC server that begins shutting down cancels the calls
# that reach it before the client has read its GOAWAY (gRPC core's Server::CallData::StartNewRpc kills them as
# "zombies", whichever front; a few in thousands under load through the close), and a Predict is a pure function of
# its request, safe to repeat. The client's own cancellations and deadlines are never retried.
_RETRY_CANCELLED = json.dumps({"methodConfig": [{
    "name": [{"service": "recship.serving.v1.Predictor", "method": "Predict"}],
    "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.01s", "maxBackoff": "0.05s", "backoffMultiplier": 2,
                    "retryableStatusCodes": ["CANCELLED"]},
}]})


class PredictClient:
    """A client of recship's Predictor service. ``credentials``: grpc.ssl_channel_credentials(...) for a server
    started with --tls-cert (None: plaintext); ``timeout``: seconds each call may take."""

    def __init__(self, target: str, timeout: float = 10.0, credentials: Optional[grpc.ChannelCredentials] = None) -> None:
        options = [("grpc.enable_retries", 1), ("grpc.service_config", _RETRY_CANCELLED)]
        self.channel = (grpc.secure_channel(target, credentials, options) if credentials is not None
                        else grpc.insecure_channel(target, options))
        self.stub = pb_grpc.PredictorStub(self.channel)
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "PredictClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def request(model: str, sparse: Sparse, dense: Optional[Dense] = None, weights: Optional[Mapping[str, Sequence[Sequence[float]]]] = None,
                version: int = 0, request_id: str = "") -> pb.PredictRequest:
        """A PredictRequest from {feature: [[ids of example 0], ...]} (or a KJT) and a dense [B, n] matrix.

        Values are taken as the REST front takes JSON tensors: ids must be ints (Python's or numpy's), weights and
        dense values ints or floats; anything else (1.5, "1", True) is a ValueError in REST's words, never truncated
        or coerced. Non-finite values are sent: the server refuses them."""
        features = []
        if hasattr(sparse, "to_dict") and hasattr(sparse, "stride"):  # a KeyedJaggedTensor
            batch = sparse.stride()
            for name, jt in sparse.to_dict().items():
                w = jt.weights_or_none()
                features.append(pb.SparseFeature(name=name, lengths=jt.lengths().tolist(), ids=jt.values().tolist(),
                                                 weights=[] if w is None else w.tolist()))
        else:
            for name in weights or {}:
                if name not in sparse:
                    raise ValueError(f'weights for {shown(name)}, which "sparse" does not have')
            batch = -1
            for name, rows in sparse.items():
                ids, lengths = _rows(rows, f"sparse feature {shown(name)} must be a list of examples, each a list of ids")
                batch = len(lengths) if batch < 0 else batch  # the first feature's
                _numbers(f"{name}.values", "INT64", ids)
                w = (weights or {}).get(name)
                given, _ = _rows(w, f"weights of {shown(name)} must be a list of examples, each a list of weights") if w is not None else ([], [])
                _numbers(f"{name}.weights", "FP32", given)
                features.append(pb.SparseFeature(name=name, lengths=lengths, ids=ids, weights=given))
        batch = max(batch, 0)
        d = np.zeros((batch, 0), dtype=np.float32) if dense is None else _dense(dense)
        return pb.PredictRequest(
            model_name=model, model_version=version, request_id=request_id, batch_size=batch, sparse=features,
            dense=pb.DenseMatrix(rows=d.shape[0], cols=d.shape[1], values=d.reshape(-1).tolist()) if d.size else pb.DenseMatrix(),
        )

    def predict(self, model: str, sparse: Sparse, dense: Optional[Dense] = None, weights: Optional[Weights] = None, version: int = 0, timeout: Optional[float] = None) -> Dict[str, np.ndarray]:
        return outputs_of(self.predict_response(model, sparse, dense, weights, version, timeout))

    def predict_response(self, model: str, sparse: Sparse, dense: Optional[Dense] = None, weights: Optional[Weights] = None,
                         version: int = 0, timeout: Optional[float] = None) -> pb.PredictResponse:
        """The PredictResponse itself: its outputs (``outputs_of``) and the model version that answered."""
        return self.stub.Predict(self.request(model, sparse, dense, weights, version), timeout=timeout or self.timeout)

    def metadata(self, model: str, version: int = 0):
        return self.stub.GetModelMetadata(pb.ModelMetadataRequest(model_name=model, model_version=version), timeout=self.timeout)

    def list_models(self) -> List[str]:
        return [m.name for m in self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout).models]


def _rows(rows: Any, what: str) -> Tuple[List[Any], List[int]]:
    """(the values, flat, and the row sizes) of a list of rows (lists, tuples or numpy arrays); ValueError ``what``.
    numpy values come as the Python ints, floats and bools they hold, so the strict check below sees them as JSON would."""
    if not isinstance(rows, (list, tuple, np.ndarray)):
        raise ValueError(what)
    flat: List[Any] = []
    sizes = []
    for row in rows:
        if isinstance(row, np.ndarray):
            row = row.tolist()
        if not isinstance(row, (list, tuple)):
            raise ValueError(what)
        flat += [x.item() if isinstance(x, np.generic) else x for x in row]
        sizes.append(len(row))
    return flat, sizes


def _numbers(name: str, datatype: str, values: List[Any]) -> None:
    """Refuses what REST refuses as KServe input ``name`` (a fractional, string or boolean id...), in its words."""
    error = number_error(name, datatype, values)
    if error is not None:
        raise ValueError(error)


def _dense(dense: Dense) -> np.ndarray:
    """float32 [B, n] of the dense rows; non-numbers refused as REST refuses its ``dense`` input."""
    if isinstance(dense, np.ndarray) and dense.dtype.kind in "iuf" and dense.ndim == 2:
        return dense.astype(np.float32)
    values, sizes = _rows(dense, '"dense" must be a list of rows, each a list of numbers')
    _numbers("dense", "FP32", values)
    for i, size in enumerate(sizes):
        if size != sizes[0]:
            raise ValueError(f"dense rows must all have the same length: row 0 has {sizes[0]} values, row {i} has {size}")
    return np.asarray(values, dtype=np.float32).reshape(len(sizes), sizes[0] if sizes else 0)


def outputs_of(response: pb.PredictResponse) -> Dict[str, np.ndarray]:
    return {t.name: np.asarray(t.values, dtype=np.float32).reshape(list(t.shape)) for t in response.outputs}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:8500", help="the server's gRPC address, host:port (default 127.0.0.1:8500)")
    parser.add_argument("--model-name", dest="model", metavar="NAME", required=True,
                        help="the model's name in the server's repository, its folder (required)")
    parser.add_argument("--model-version", dest="version", metavar="N", type=int, default=0,
                        help="the model version to ask for; 0 asks for the newest the server serves (default 0)")
    parser.add_argument("--request", required=True, metavar="FILE",
                        help='a JSON file, or - for standard input: {"sparse": {"f": [[1, 2], [3]]}, "dense": [[...]], '
                             '"weights": {...}} (required)')
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                        help="how long the call may take before DEADLINE_EXCEEDED (default 10)")
    parser.add_argument("--tls-ca", metavar="PEM", help="speak TLS, trusting this CA's certificates (a server started with "
                                                         "--tls-cert) (default: plaintext)")
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate chain for mutual TLS (a server started with "
                                                           "--tls-client-ca); needs --tls-key and --tls-ca (default: none)")
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert (default: none)")


def read_request(path: Path, text: Optional[str] = None) -> Dict[str, Any]:
    """A ``recship predict`` request file, read as recship_predict reads one (in its words): strict JSON, an
    object of "sparse" (an object of features), optional "dense" and "weights" (an object of features; the
    values themselves are PredictClient.request's to check)."""

    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        body = json.loads(path.read_text() if text is None else text, parse_constant=no_constant)
    except ValueError as e:  # JSONDecodeError, bad UTF-8, NaN or Infinity
        raise ValueError(f"the request file {path} is not JSON: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("sparse"), dict):
        raise ValueError('the request must be a JSON object with a "sparse" object')
    for key in body:
        if key not in ("sparse", "dense", "weights"):
            raise ValueError(f'unknown key {shown(key)} in the request: it takes "sparse", "dense" and "weights"')
    if not isinstance(body.get("weights", {}), dict):
        raise ValueError('"weights" must be an object of features, like "sparse"')
    return body


def credentials_of(ca: Optional[str], cert: Optional[str], key: Optional[str]) -> Optional[grpc.ChannelCredentials]:
    """TLS channel credentials from PEM files (None without --tls-ca); ValueError naming a file that is missing or a
    half-given client certificate."""
    if ca is None:
        if cert is not None or key is not None:
            raise ValueError("--tls-cert and --tls-key need --tls-ca (the CA that signed the server's certificate)")
        return None
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together (a client certificate and its key)")
    pem = {}
    for flag, file in (("--tls-ca", ca), ("--tls-cert", cert), ("--tls-key", key)):
        if file is not None:
            try:
                pem[flag] = Path(file).read_bytes()
            except OSError as e:
                raise ValueError(f"{flag} {file}: {e.strerror}") from None
    return grpc.ssl_channel_credentials(root_certificates=pem["--tls-ca"], private_key=pem.get("--tls-key"),
                                        certificate_chain=pem.get("--tls-cert"))


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    credentials = credentials_of(args.tls_ca, args.tls_cert, args.tls_key)
    if args.request == "-":
        body = read_request(Path("<stdin>"), sys.stdin.read())
    else:
        path = Path(args.request)
        if not path.is_file():
            raise FileNotFoundError(f"request file not found: {path}")
        body = read_request(path)
    with PredictClient(args.target, timeout=args.timeout, credentials=credentials) as client:
        try:
            response = client.predict_response(args.model, body["sparse"], body.get("dense"), body.get("weights"), args.version)
        except grpc.RpcError as e:
            raise ValueError(f"{e.code().name}: {e.details()}") from None
    print(json.dumps({k: v.tolist() for k, v in outputs_of(response).items()}))
    print(f"recship predict: {response.model_name} version {response.model_version} answered", file=sys.stderr)
    return 0
