"""The settings of ``recship serve``: the server's (``ServerConfig``, its flags) and each model's (``ModelSettings``:
the server's batching flags, overridden by ``DIR/<model>/config.yaml``), their ranges and their checks, and the
``--trusted-sha256`` allow-list file. Torch-free and grpc-free: ``recship serve --help`` and config checks import it.
"""

import dataclasses
import math
import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from recship.flags import parse_mapping
from recship.names import DEVICES, ID_POLICIES, LOAD_FORMATS
from recship.serving.values import shown

# Upper bounds of the settings: past them something overflows (gRPC's message sizes are int32 and the transport
# admits twice --max-message-mb; a wait's timeout; a thread count) or the setting is surely a mistake.
MAX_MESSAGE_BYTES = 2**30 - 1
MAX_DELAY_MS = 60_000  # a batch waiting a minute for company is no batching
MAX_SECONDS = 86_400  # --poll-interval, the HTTP idle timeout
MAX_TORCH_THREADS = 1024


def number_in(value: object, lo: float, hi: float, integer: bool = False) -> bool:
    """``value`` is a number (an int if ``integer``; never a bool, NaN or infinity) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    return math.isfinite(value) and lo <= value <= hi


def megabytes(flag: str, mb: float, below: float = math.inf) -> int:
    """A size flag in MB as bytes; ValueError naming the flag unless it is a finite number above 0 (and below ``below``)."""
    if not (number_in(mb, 0, math.inf) and 0 < mb < below):
        raise ValueError(f"{flag} takes a number of MB above 0{'' if below == math.inf else f' and below {below:g}'}, got {mb!r}")
    return int(mb * 1024 * 1024)


@dataclass
class ServerConfig:
    model_repo: str
    host: str = "127.0.0.1"
    port: int = 8500
    metrics_port: Optional[int] = None
    metrics_host: Optional[str] = None  # None: the same as host
    max_batch_size: int = 512
    max_delay_ms: float = 2.0
    batching: bool = True  # False: every request runs alone (one request per forward)
    max_queue: int = 1024
    poll_interval_s: float = 2.0
    torch_threads: Optional[int] = None
    max_message_bytes: int = 64 * 1024 * 1024
    max_inflight_bytes: int = 256 * 1024 * 1024  # request bytes being served at once, all fronts together (the C++ front: its own as much)
    device: str = "cpu"
    http_port: Optional[int] = None  # KServe v2 REST front (serving/rest.py); None: off
    http_idle_timeout_s: float = 30.0  # an HTTP connection that sends nothing for this long is closed
    reflection: bool = True
    tls_cert: Optional[str] = None  # PEM certificate chain and key: every listener speaks TLS
    tls_key: Optional[str] = None
    tls_client_ca: Optional[str] = None  # PEM CA bundle: clients must present a certificate it signed (mTLS)
    trusted_sha256: Optional[str] = None  # allow-list file of manifest.json sha256s (each pins its version); None: any artifact loads
    model_format: str = "auto"  # auto: model.pt2 (AOTInductor) where it runs here, else model.pt; torchscript | aoti: only that
    front: str = "python"  # cpp: the C++ gRPC front answers Predict (serving/front.py); python: this process answers all
    model_control: str = "poll"  # poll: the repository's models load and follow it; explicit: only what load/unload asks for
    load_models: List[str] = field(default_factory=list)  # explicit mode: the models loaded at startup ("*": all)

    def __post_init__(self) -> None:
        self._check_numbers()
        if self.device not in DEVICES:
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.front not in ("python", "cpp"):
            raise ValueError(f"--front must be python or cpp, got {self.front!r}")
        if self.front == "cpp" and self.device != "cpu":
            raise ValueError("--front cpp runs models on the CPU; use --front python with --device cuda")
        if self.model_control not in ("poll", "explicit"):
            raise ValueError(f"--model-control must be poll or explicit, got {self.model_control!r}")
        if self.load_models and self.model_control != "explicit":
            raise ValueError("--load-model applies with --model-control explicit (polling loads every model)")
        if self.model_format not in LOAD_FORMATS:
            raise ValueError(f"--model-format must be auto, torchscript or aoti, got {self.model_format!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "trusted_sha256"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')}: no such file: {path}")

    def _check_numbers(self) -> None:
        """Every numeric setting in its range, whichever way it came (flags, a --config file, the Python API): a
        ValueError naming the flag, in one line, rather than a server that starts and refuses everything."""
        for name in ("port", "http_port", "metrics_port"):
            value = getattr(self, name)
            if not (value is None and name != "port") and not number_in(value, 0, 65535, integer=True):
                raise ValueError(f"--{name.replace('_', '-')} takes a port number from 0 to 65535 (0: any free port), got {value!r}")
        for name in ("max_batch_size", "max_queue"):
            if not number_in(getattr(self, name), 1, math.inf, integer=True):
                raise ValueError(f"--{name.replace('_', '-')} takes an integer >= 1, got {getattr(self, name)!r}")
        if self.torch_threads is not None and not number_in(self.torch_threads, 1, MAX_TORCH_THREADS, integer=True):
            raise ValueError(f"--torch-threads takes an integer from 1 to {MAX_TORCH_THREADS} (or none: the default), got {self.torch_threads!r}")
        if not number_in(self.max_delay_ms, 0, MAX_DELAY_MS):
            raise ValueError(f"--max-delay-ms takes a number from 0 to {MAX_DELAY_MS}, got {self.max_delay_ms!r}")
        for name, flag in (("poll_interval_s", "--poll-interval"), ("http_idle_timeout_s", "http_idle_timeout_s")):
            value = getattr(self, name)
            if not (number_in(value, 0, MAX_SECONDS) and value > 0):
                raise ValueError(f"{flag} takes a number above 0, up to {MAX_SECONDS}, got {value!r}")
        if not number_in(self.max_message_bytes, 1, MAX_MESSAGE_BYTES, integer=True):
            raise ValueError(f"--max-message-mb takes a number of MB above 0 and below 1024 (1 to {MAX_MESSAGE_BYTES} bytes), "
                             f"got {self.max_message_bytes!r} bytes")
        if not number_in(self.max_inflight_bytes, 1, 2**63 - 1, integer=True):
            raise ValueError(f"--max-inflight-mb takes a number of MB above 0 (1 to {2**63 - 1} bytes), got {self.max_inflight_bytes!r} bytes")

    def ssl_context(self) -> Optional[ssl.SSLContext]:
        """The TLS context of the HTTP listeners (REST), or None without TLS."""
        if self.tls_cert is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        if self.tls_client_ca is not None:
            context.load_verify_locations(self.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


MODEL_CONFIG = "config.yaml"  # DIR/<model>/config.yaml: the model's own settings (ModelSettings)
_CONFIG_KEYS = ("max_batch_size", "max_delay_ms", "batching", "max_queue", "torch_threads", "version_policy", "id_policy")


class ConfigError(ValueError):
    """A model's config.yaml is bad, or does not fit one of its versions; the message names the file and the key."""


@dataclass(frozen=True)
class ModelSettings:
    """How one model is served: the server's flags, overridden by the model's config.yaml.

    version_policy: ("latest", N) the N newest loadable versions; ("all",) every loadable version;
    ("specific", (v, ...)) those versions. id_policy: (feature, "reject" | "modulo") overrides of
    the artifact's id policies, applied by validation (before the model, so either way every id
    that reaches the model is inside its table).
    """

    max_batch_size: int
    max_delay_ms: float
    batching: bool
    max_queue: int
    torch_threads: Optional[int]
    version_policy: Tuple = ("latest", 1)
    id_policy: Tuple[Tuple[str, str], ...] = ()

    @staticmethod
    def defaults(config: "ServerConfig") -> "ModelSettings":
        """The server's flags (``ServerConfig``) as a model's settings."""
        return ModelSettings(config.max_batch_size, float(config.max_delay_ms), bool(config.batching), config.max_queue,
                             config.torch_threads)

    def runtime(self) -> Tuple:
        """What a served version runs with (all but the version policy): a change restarts its batcher."""
        return (self.max_batch_size, self.max_delay_ms, self.batching, self.max_queue, self.torch_threads, self.id_policy)

    def front_settings(self) -> Dict[str, Any]:
        """The ``settings`` of the C++ front's load command (serving/front.py)."""
        return {"max_batch_size": self.max_batch_size, "max_delay_ms": self.max_delay_ms, "batching": self.batching,
                "max_queue": self.max_queue, "threads": self.torch_threads or default_torch_threads()}


def read_model_config(path: Path, text: str, defaults: ModelSettings) -> ModelSettings:
    """A model's config.yaml (its ``text``) over ``defaults``; ConfigError naming the file and the key if it is bad."""
    try:
        values = parse_mapping(text)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    settings: Dict[str, Any] = {}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        if dest not in _CONFIG_KEYS:
            keys = ", ".join(k.replace("_", "-") for k in sorted(_CONFIG_KEYS))
            raise ConfigError(f"{path}: unknown key {shown(key)}; the keys are: {keys}")
        if dest in settings:
            raise ConfigError(f"{path}: {key}: given twice (with - and _)")
        where = f"{path}: {key}"
        if dest in ("max_batch_size", "max_queue"):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{where}: takes an integer >= 1, got {config_value(value)}")
        elif dest == "torch_threads":
            if value is not None and (type(value) is not int or not 1 <= value <= MAX_TORCH_THREADS):
                raise ConfigError(f"{where}: takes an integer from 1 to {MAX_TORCH_THREADS} (or null: the server's), got {config_value(value)}")
        elif dest == "max_delay_ms":
            if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= MAX_DELAY_MS:
                raise ConfigError(f"{where}: takes a number from 0 to {MAX_DELAY_MS}, got {config_value(value)}")
            value = float(value)
        elif dest == "batching":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: takes true or false, got {config_value(value)}")
        elif dest == "version_policy":
            value = _version_policy(where, value)
        else:
            value = _id_policy(where, value)
        settings[dest] = value
    if settings.get("torch_threads", 0) is None:
        settings["torch_threads"] = defaults.torch_threads
    return dataclasses.replace(defaults, **settings)


def _version_policy(where: str, value: Any) -> Tuple:
    """Triton's version policies: ``latest: N`` (or ``{num_versions: N}``), ``all`` (or ``all: {}``),
    ``specific: [v, ...]`` (or ``{versions: [...]}``)."""
    usage = "takes latest: N, all, or specific: [versions]"
    if value == "all":
        return ("all",)
    if not isinstance(value, dict) or len(value) != 1:
        raise ConfigError(f"{where}: {usage}, got {config_value(value)}")
    (kind, arg), = value.items()
    if kind == "all" and arg in (None, {}):
        return ("all",)
    if kind == "latest":
        n = arg.get("num_versions") if isinstance(arg, dict) and set(arg) == {"num_versions"} else arg
        if type(n) is not int or n < 1:
            raise ConfigError(f"{where}: latest takes a number of versions >= 1, got {config_value(arg)}")
        return ("latest", n)
    if kind == "specific":
        versions = arg.get("versions") if isinstance(arg, dict) and set(arg) == {"versions"} else arg
        if not isinstance(versions, list) or not versions or not all(type(v) is int and 0 < v < 10**18 for v in versions):
            raise ConfigError(f"{where}: specific takes a list of version numbers >= 1, got {config_value(arg)}")
        return ("specific", tuple(sorted(set(versions), reverse=True)))
    raise ConfigError(f"{where}: {usage}, got {config_value(value)}")


def _id_policy(where: str, value: Any) -> Tuple[Tuple[str, str], ...]:
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where}: takes a mapping of sparse features to reject or modulo, got {config_value(value)}")
    for feature, policy in value.items():
        if not isinstance(feature, str) or policy not in ID_POLICIES:
            raise ConfigError(f"{where}: {shown(feature)}: takes reject or modulo, got {config_value(policy)}")
    return tuple(sorted(value.items()))


def config_value(value: Any) -> str:
    """A config value for a message: its repr (a number unquoted), cut to 64 characters."""
    text = repr(value)
    return text if len(text) <= 64 else text[:64] + f"... ({len(text)} characters)"


def default_torch_threads() -> int:
    """Intra-op threads for the forwards: every core but one (left to the request path), from 3 cores up.

    On 2 cores that split would halve the forward (bench/serve_bench.py measures a 512-example forward
    with 1 thread and with 2).
    """
    cores = os.cpu_count() or 1
    return cores - 1 if cores > 2 else cores


def read_trusted(path: str) -> FrozenSet[str]:
    """The allow-list file: one manifest.json sha256 per line (``sha256sum */*/manifest.json`` output works: the
    first word counts); # comments. A listed manifest pins every file of its version through its checksums."""
    digests = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        word = line.split("#", 1)[0].split()[:1]
        if not word:
            continue
        if not re.fullmatch(r"[0-9a-fA-F]{64}", word[0]):
            raise ValueError(f"{path}:{number}: not a sha256: {shown(word[0])}")
        digests.add(word[0].lower())
    return frozenset(digests)
