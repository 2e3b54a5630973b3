"""recship's log lines: one formatter for the server, trainer and exporter.

``--log-format json`` writes one JSON object per line (time, level, logger, message, and the
model/version/status a request log carries); ``text`` writes ``time LEVEL logger: message``.
"""

import json
import logging

class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the model/version/status a request log carries."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("method", "model", "version", "status"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["trace"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(fmt: str = "json") -> None:
    """Sends recship's log lines (INFO and up; other libraries' from WARNING) to stderr in ``fmt``: json or text."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # recship's own lines at INFO; other libraries (fbgemm_gpu logs every .so it loads) at WARNING
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("recship").setLevel(logging.INFO)
