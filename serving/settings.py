"""The settings of ``recship serve``: the server's (``ServerConfig``, its flags) and each model's (``ModelSettings``:
the server's batching flags, overridden by ``DIR/<model>/config.yaml``), their ranges and their checks, and the
``--trusted-sha256`` allow-list file. Torch-free and grpc-free: ``recship serve --help`` and config checks import it.
"""

import dataclasses
import math
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from recship.cpus import usable_cpus
from recship.flags import parse_mapping, resolve_device
from recship.names import DEVICE_CHOICES, ID_POLICIES, LOAD_FORMATS
from recship.oserrors import doing
from recship.serving.rules import LIMITS
from recship.serving.values import shown

# Upper bounds of the settings the serving rules do not hold (serving/rules.py has the batching and admission
# ones: gRPC's message sizes are int32 and the transport admits twice --max-message-mb; a batch waiting a minute for
# company is no batching): past them a wait's timeout or a thread count overflows, or the setting is surely a mistake.
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


@dataclass(frozen=True)
class Range:
    """A numeric setting's range: [lo, hi] (``open_low``: lo itself excluded), an int if ``integer``; ``none`` says
    what None means where it is allowed ("" where it is not); ``what`` words the range itself, when it has a name."""

    lo: float
    hi: float = math.inf
    integer: bool = False
    open_low: bool = False
    none: str = ""
    what: str = ""

    def holds(self, value: object) -> bool:
        if value is None:
            return bool(self.none)
        return number_in(value, self.lo, self.hi, self.integer) and (value > self.lo or not self.open_low)  # type: ignore[operator]

    def text(self, none: Optional[str] = None) -> str:
        """"takes ..." as a message says it (``none``: what None means here, where None is allowed)."""
        if self.what:
            return f"takes {self.what}"
        none = "" if not self.none else self.none if none is None else none
        lo, hi = _number(self.lo), _number(self.hi)
        if self.integer:
            what = f"an integer >= {lo}" if self.hi == math.inf else f"an integer from {lo} to {hi}"
        elif self.open_low:
            what = f"a number above {lo}, up to {hi}"
        else:
            what = f"a number from {lo} to {hi}"
        return f"takes {what}" + (f" (or {none})" if none else "")


def _number(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and float(x).is_integer() else f"{x:g}"


PORT = Range(0, 65535, integer=True, what="a port number from 0 to 65535 (0: any free port)")


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: Optional[str] = None, range: Optional[Range] = None,
            choices: Optional[Tuple[str, ...]] = None, per_model: bool = False, megabytes_below: Optional[float] = None,
            default_text: Optional[str] = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A ServerConfig field, with what makes it a flag and a config key: ``help`` (its flag's sentence; "" for a
    field of the Python API only), ``flag`` (default ``--<name>``), its ``range`` or ``choices``, ``per_model`` (a
    model's config.yaml may set it), ``megabytes_below`` (a size in bytes whose flag takes MB below this),
    ``default_text`` (the default as --help says it, when the value itself would not say it well)."""
    metadata = {"help": help, "flag": flag, "range": range, "choices": choices, "per_model": per_model,
                "megabytes_below": megabytes_below, "default_text": default_text}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def ruled(name: str, **options: Any) -> Any:
    """A ServerConfig field whose default, range and help are the serving rules' (serving/rules.py LIMITS[name])."""
    limit = LIMITS[name]
    return setting(limit.default, limit.help, range=Range(limit.lo, limit.hi, integer=limit.integer), **options)


@dataclass
class ServerConfig:
    """Everything ``recship serve`` is told: each field is a flag (``--max-batch-size``), a ``--config`` file key
    (``max-batch-size`` or ``max_batch_size``) and, if ``per_model``, a key of a model's config.yaml
    (``ModelSettings``); its range is checked here, whichever way it came."""

    model_repo: str = setting(help="the model repository: a directory of <model>/<version>/ artifacts")
    host: str = setting("127.0.0.1", "address every listener binds")
    port: int = setting(8500, "gRPC port: Predictor, KServe v2, health", range=PORT)
    metrics_port: Optional[int] = setting(None, "serve Prometheus metrics over HTTP on this port",
                                          range=dataclasses.replace(PORT, none="none"), default_text="no metrics listener")
    metrics_host: Optional[str] = setting(None, "address of the metrics listener", default_text="--host")
    http_port: Optional[int] = setting(None, "also answer KServe v2 over HTTP/REST on this port",
                                       range=dataclasses.replace(PORT, none="none"), default_text="no REST listener")
    max_batch_size: int = ruled("max_batch_size", per_model=True)
    max_delay_ms: float = ruled("max_delay_ms", per_model=True)
    batching: bool = setting(True, "merge concurrent requests into one forward; --no-batching runs each request alone",
                             per_model=True)
    max_queue: int = ruled("max_queue", per_model=True)
    drain_delay_s: float = setting(5.0, "on SIGTERM, seconds that readiness answers 503 (gRPC health NOT_SERVING) while every "
                                        "listener keeps serving, so that load balancers stop sending before it closes; then "
                                        "requests in flight and queued finish", flag="--drain-delay", range=Range(0, MAX_SECONDS))
    poll_interval_s: float = setting(2.0, "seconds between repository scans", flag="--poll-interval",
                                     range=Range(0, MAX_SECONDS, open_low=True))
    torch_threads: Optional[int] = setting(None, "intra-op threads per forward", range=Range(1, MAX_TORCH_THREADS, integer=True,
                                           none="none: the default"), per_model=True,
                                           default_text="usable CPUs (affinity, cgroup quota) - 1 from 3 up, else all")
    max_message_bytes: int = ruled("max_message_bytes", flag="--max-message-mb", megabytes_below=1024)
    max_inflight_bytes: int = ruled("max_inflight_bytes", flag="--max-inflight-mb", megabytes_below=math.inf)
    device: str = setting("cpu", "where models run; artifacts must be exported for it; auto: cuda where torch sees a GPU, "
                                 "else cpu", choices=DEVICE_CHOICES)
    http_idle_timeout_s: float = setting(30.0, range=Range(0, MAX_SECONDS, open_low=True))  # an idle HTTP connection is closed
    reflection: bool = setting(True, "gRPC server reflection for Predictor and health")
    tls_cert: Optional[str] = setting(None, "PEM certificate chain: gRPC, HTTP and metrics listeners speak TLS", default_text="plaintext")
    tls_key: Optional[str] = setting(None, "PEM private key of --tls-cert", default_text="none")
    tls_client_ca: Optional[str] = setting(None, "PEM CA bundle; clients must present a certificate it signed, mutual TLS",
                                           default_text="no client certificates")
    trusted_sha256: Optional[str] = setting(
        None, "allow-list file of manifest.json sha256s, one a line (sha256sum */*/manifest.json output works); a listed "
              "manifest pins every file of its version through its checksums, and a version whose manifest is not listed is "
              "refused", default_text="any artifact loads")
    model_format: str = setting("auto", "which model file runs: aoti (model.pt2; an artifact without one is refused), "
                                        "torchscript (model.pt), auto: model.pt2 where the artifact has one this CPU and torch "
                                        "can run", choices=LOAD_FORMATS)
    front: str = setting("python", "cpp: a C++ gRPC front (built from cpp_loader/ on first use) answers Predict without "
                                   "Python per request and forwards every other call to this process", choices=("python", "cpp"))
    model_control: str = setting("poll", "poll: every model in --model-repo loads and follows its folder (new versions, "
                                         "removals); explicit: models load and unload only when asked, through the repository "
                                         "API (RepositoryModelLoad / POST /v2/repository/models/M/load) or --load-model",
                                 choices=("poll", "explicit"))
    load_models: List[str] = setting(help="with --model-control explicit: load this model at startup, repeatable; '*' loads "
                                          "every model", flag="--load-model", default_factory=list, default_text="none")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = f.metadata.get("range")
            value = getattr(self, f.name)
            if check is not None and not check.holds(value):
                raise ValueError(f"{flag_of(f)} {range_text(f)}, got {value!r}{' bytes' if f.metadata['megabytes_below'] else ''}")
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise ValueError(f"{flag_of(f)} must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}")
        self.device = resolve_device(self.device)
        if self.front == "cpp" and self.device != "cpu":
            raise ValueError("--front cpp runs models on the CPU; use --front python with --device cuda")
        if self.load_models and self.model_control != "explicit":
            raise ValueError("--load-model applies with --model-control explicit (polling loads every model)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "trusted_sha256"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')}: no such file: {path}")

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


def flag_of(f: "dataclasses.Field[Any]") -> str:
    """A ServerConfig field's flag (its name, for a field of the Python API only)."""
    if not f.metadata.get("help"):
        return f.name
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def range_text(f: "dataclasses.Field[Any]", none: Optional[str] = None) -> str:
    """What a numeric field takes, as its messages say it."""
    check: Range = f.metadata["range"]
    if f.metadata.get("megabytes_below"):
        below = f.metadata["megabytes_below"]
        return f"takes a number of MB above 0{'' if below == math.inf else f' and below {below:g}'} (1 to {_number(check.hi)} bytes)"
    return check.text(none)


SERVER_FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}
PER_MODEL = tuple(name for name, f in SERVER_FIELDS.items() if f.metadata["per_model"])  # what a model's config.yaml may set


MODEL_CONFIG = "config.yaml"  # DIR/<model>/config.yaml: the model's own settings (ModelSettings)
_CONFIG_KEYS = PER_MODEL + ("version_policy", "id_policy")


class ConfigError(ValueError):
    """A model's config.yaml is bad, or does not fit one of its versions; the message names the file and the key."""


@dataclass(frozen=True)
class VersionPolicy:
    """Which of a model's loadable versions are served, as Triton's version_policy says: the ``latest`` N (``kind``
    "latest", ``count`` N), ``all`` of them, or ``specific`` ones (``versions``, newest first)."""

    kind: str = "latest"
    count: int = 1
    versions: Tuple[int, ...] = ()

    def choose(self, versions: List[int]) -> List[int]:
        """Of ``versions`` (newest first), those this policy may serve, newest first (the latest N: the first N of
        them that load, so every one is a candidate)."""
        return [v for v in versions if v in self.versions] if self.kind == "specific" else list(versions)

    @property
    def limit(self) -> Optional[int]:
        """How many versions are served at most (None: no limit)."""
        return self.count if self.kind == "latest" else None

    def to_triton(self) -> Dict[str, Any]:
        """ModelConfig's version_policy, as JSON."""
        if self.kind == "latest":
            return {"latest": {"num_versions": self.count}}
        return {"all": {}} if self.kind == "all" else {"specific": {"versions": list(self.versions)}}

    def __str__(self) -> str:
        return f"latest: {self.count}" if self.kind == "latest" else "all" if self.kind == "all" else f"specific: {list(self.versions)}"


@dataclass(frozen=True)
class ModelSettings:
    """How one model is served: the server's flags, overridden by the model's config.yaml.

    The first fields are ServerConfig's ``per_model`` ones, same names (checked below): a per-model knob is a
    ServerConfig field marked ``per_model`` and its field here; flags, config files, config.yaml, the C++ front's
    settings and ModelConfig's parameters follow from them. version_policy: which versions are served
    (``VersionPolicy``). id_policy: (feature, "reject" | "modulo") overrides of
    the artifact's id policies, applied by validation (before the model, so either way every id
    that reaches the model is inside its table).
    """

    max_batch_size: int
    max_delay_ms: float
    batching: bool
    max_queue: int
    torch_threads: Optional[int]
    version_policy: VersionPolicy = VersionPolicy()
    id_policy: Tuple[Tuple[str, str], ...] = ()

    @staticmethod
    def defaults(config: "ServerConfig") -> "ModelSettings":
        """The server's flags (``ServerConfig``) as a model's settings."""
        return ModelSettings(**{name: _model_value(name, getattr(config, name)) for name in PER_MODEL})

    def runtime(self) -> Tuple:
        """What a served version runs with (all but the version policy): a change restarts its batcher."""
        return tuple(getattr(self, name) for name in PER_MODEL) + (self.id_policy,)

    def front_settings(self) -> Dict[str, Any]:
        """The ``settings`` of the C++ front's load command (serving/front.py): the per-model ones by the same names,
        the default thread count resolved."""
        settings = {name: getattr(self, name) for name in PER_MODEL}
        settings["torch_threads"] = settings["torch_threads"] or default_torch_threads()
        return settings


if tuple(f.name for f in dataclasses.fields(ModelSettings))[:len(PER_MODEL)] != PER_MODEL:
    raise TypeError(f"ModelSettings must begin with ServerConfig's per-model fields {PER_MODEL}")


def _model_value(name: str, value: Any) -> Any:
    """A per-model value as ModelSettings holds it: numbers of a float setting as floats."""
    check = SERVER_FIELDS[name].metadata["range"]
    return float(value) if check is not None and not check.integer and value is not None else value


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
        if dest in PER_MODEL:  # the flag's own rule (ServerConfig's field), null meaning the server's value
            check = SERVER_FIELDS[dest].metadata["range"]
            if check is None and not isinstance(value, bool):
                raise ConfigError(f"{where}: takes true or false, got {config_value(value)}")
            if check is not None and not check.holds(value):
                raise ConfigError(f"{where}: {check.text(none='null: the server' + chr(39) + 's')}, got {config_value(value)}")
            value = _model_value(dest, value)
        elif dest == "version_policy":
            value = _version_policy(where, value)
        else:
            value = _id_policy(where, value)
        settings[dest] = value
    if settings.get("torch_threads", 0) is None:
        settings["torch_threads"] = defaults.torch_threads
    return dataclasses.replace(defaults, **settings)


def _version_policy(where: str, value: Any) -> VersionPolicy:
    """Triton's version policies: ``latest: N`` (or ``{num_versions: N}``), ``all`` (or ``all: {}``),
    ``specific: [v, ...]`` (or ``{versions: [...]}``)."""
    usage = "takes latest: N, all, or specific: [versions]"
    if value == "all":
        return VersionPolicy("all")
    if not isinstance(value, dict) or len(value) != 1:
        raise ConfigError(f"{where}: {usage}, got {config_value(value)}")
    (kind, arg), = value.items()
    if kind == "all" and arg in (None, {}):
        return VersionPolicy("all")
    if kind == "latest":
        n = arg.get("num_versions") if isinstance(arg, dict) and set(arg) == {"num_versions"} else arg
        if type(n) is not int or n < 1:
            raise ConfigError(f"{where}: latest takes a number of versions >= 1, got {config_value(arg)}")
        return VersionPolicy("latest", n)
    if kind == "specific":
        versions = arg.get("versions") if isinstance(arg, dict) and set(arg) == {"versions"} else arg
        if not isinstance(versions, list) or not versions or not all(type(v) is int and 0 < v < 10**18 for v in versions):
            raise ConfigError(f"{where}: specific takes a list of version numbers >= 1, got {config_value(arg)}")
        return VersionPolicy("specific", versions=tuple(sorted(set(versions), reverse=True)))
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
    """Intra-op threads for the forwards: every usable CPU but one (left to the request path), from 3 up.

    Usable: the affinity mask, capped by the cgroup CPU quota (``recship.cpus``: a pod limited to 2 CPUs
    on a 64-core node gets 2, not 63). On 2 CPUs that split would halve the forward
    (bench/serve_bench.py measures a 512-example forward with 1 thread and with 2).
    """
    cores = usable_cpus()
    return cores - 1 if cores > 2 else cores


def read_trusted(path: str) -> FrozenSet[str]:
    """The allow-list file: one manifest.json sha256 per line (``sha256sum */*/manifest.json`` output works: the
    first word counts); # comments. A listed manifest pins every file of its version through its checksums."""
    digests = set()
    with doing("reading --trusted-sha256"):
        text = Path(path).read_text()
    for number, line in enumerate(text.splitlines(), 1):
        word = line.split("#", 1)[0].split()[:1]
        if not word:
            continue
        if not re.fullmatch(r"[0-9a-fA-F]{64}", word[0]):
            raise ValueError(f"{path}:{number}: not a sha256: {shown(word[0])}")
        digests.add(word[0].lower())
    return frozenset(digests)
