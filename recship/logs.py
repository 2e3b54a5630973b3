"""recship's log lines: one formatter for the server, trainer and exporter.

``--log-format json`` writes one JSON object per line (time, level, logger, message, and the
model/version/status a request log carries); ``text`` writes ``time LEVEL logger: message``.

``configure_logging`` also brings what torch writes on stderr through Python into that format,
so a JSON log stays one object a line:

- Python warnings (``warnings.warn``, from torch or anywhere) become WARNING records of the
  ``py.warnings`` logger, ``"Category: message"`` with the warning's ``source`` (file:line),
  instead of the two text lines ``warnings`` prints. torch's deprecation notices for
  TorchScript (`` `torch.jit.save` is deprecated ...``) are silenced: recship writes
  ``model.pt`` on purpose, beside ``model.pt2``, and its README says TorchScript is deprecated;
  so are fbgemm_gpu-cpu's notices that its SSD lookup modules are not built (recship uses none).
- torch's own loggers (``torch``, ``torch.distributed``, ``torch.export``, ...) keep their
  levels and their stderr handler, which gets recship's formatter instead of torch's
  ``W1127 01:02:03.456 123 file.py:45] ...`` lines.

Lines written to the stderr file descriptor by C++ code without going through Python are not
seen here. Progress bars are the commands' business: they draw one only when stderr is a terminal.
"""

import json
import logging
import sys
import warnings
from typing import Any, Optional, TextIO, Type, Union

WARNINGS_LOGGER = "py.warnings"  # the logger name logging.captureWarnings uses too
# torch's FutureWarning/DeprecationWarning for torch.jit.save/load/script/script_method: recship exports
# TorchScript deliberately (model.pt beside model.pt2) and says in its README that torch 2.13 deprecates it
TORCHSCRIPT_DEPRECATION = r"`torch\.jit\.\w+` is deprecated"
# fbgemm_gpu-cpu's notices that its SSD (disk-backed table) lookups are not in the build: recship uses none
FBGEMM_SSD_IMPORTS = r"\x1b\[93m\s*Failed to import: fbgemm_gpu\.split_embedding_codegen_lookup_invokers\.\w*ssd"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
EXTRA_KEYS = ("method", "model", "version", "status", "source")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the model/version/status a request
    log carries, and the ``source`` (file:line) of a captured Python warning."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in EXTRA_KEYS:
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["trace"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def formatter(fmt: str) -> logging.Formatter:
    """The formatter of ``--log-format fmt``: json or text."""
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"log format must be json or text, got {fmt!r}")


_original_showwarning = warnings.showwarning


def _log_warning(message: Union[Warning, str], category: Type[Warning], filename: str, lineno: int,
                 file: Optional[TextIO] = None, line: Optional[str] = None) -> None:
    """``warnings.showwarning`` replacement: a warning becomes one WARNING record of ``py.warnings``.
    A warning shown into an explicit ``file`` goes there as Python would write it."""
    if file is not None:
        _original_showwarning(message, category, filename, lineno, file, line)
        return
    logging.getLogger(WARNINGS_LOGGER).warning("%s: %s", category.__name__, message, extra={"source": f"{filename}:{lineno}"})


def _adopt_torch_loggers(fmt: logging.Formatter) -> int:
    """Gives ``fmt`` to the stderr handlers torch puts on its loggers (``torch``, ``torch.distributed``,
    ...; they do not propagate to the root logger); returns how many handlers it changed.

    Only plain StreamHandlers on stderr are changed: torch's file and trace handlers keep their format.
    """
    # lazy: keeps --help torch-free (the recship command imports this module for its error lines)
    import torch._logging  # noqa: F401  (installs torch's handlers, if torch was not imported yet)

    changed = 0
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or not (name == "torch" or name.startswith("torch.")):
            continue
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and getattr(handler, "stream", None) in (sys.stderr, sys.__stderr__):
                handler.setFormatter(fmt)
                changed += 1
    return changed


def ignore_dependency_notices() -> None:
    """Hides two notices of recship's dependencies that say nothing to its users: fbgemm_gpu-cpu's that its SSD lookups
    are not in the build (printed on every import of fbgemm_gpu), and torch's that TorchScript is deprecated (printed
    when torch and fbgemm script their own modules at import, and by every export: recship writes TorchScript on
    purpose). ``import recship`` calls it, so that a process's first lines (a spawned rank's too) are not these."""
    warnings.filterwarnings("ignore", message=TORCHSCRIPT_DEPRECATION, category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=TORCHSCRIPT_DEPRECATION, category=FutureWarning)
    warnings.filterwarnings("ignore", message=FBGEMM_SSD_IMPORTS, category=DeprecationWarning)


def configure_logging(fmt: str = "json") -> None:
    """Sends recship's log lines (INFO and up; other libraries' from WARNING) to stderr in ``fmt``
    (json or text), with Python warnings and torch's own log lines in the same format (see the module's
    docstring). Calling it again replaces the previous configuration."""
    chosen = formatter(fmt)
    handler = logging.StreamHandler()
    handler.setFormatter(chosen)
    # recship's own lines at INFO; other libraries (fbgemm_gpu logs every .so it loads) at WARNING
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("recship").setLevel(logging.INFO)
    ignore_dependency_notices()
    warnings.showwarning = _log_warning
    _adopt_torch_loggers(chosen)


def error_line(command: str, error: Any, fmt: str = "text") -> str:
    """The one line a command's expected error writes on stderr: ``recship COMMAND: error: MESSAGE``, as
    text or (``fmt`` "json") as the message of an ERROR record of the ``recship`` logger."""
    text = f"recship {command}: error: {error}"
    if fmt != "json":
        return text
    return JsonFormatter().format(logging.LogRecord("recship", logging.ERROR, "", 0, text, None, None))
