"""``recship serve``: its flags (ServerConfig's fields, ``serving/settings.py``), and the process that runs a
``Server`` (``serving/server.py``) until SIGTERM or SIGINT drains and stops it.

``recship serve --config FILE`` takes every flag from a YAML/JSON file, flags on the command line winning
(``recship/flags.py`` applies it). This module imports no torch and no grpc: ``recship serve --help`` answers at once.
"""

import argparse
import atexit
import dataclasses
import logging
import os
import signal
import sys
import threading
from typing import Any, Dict

from recship.logs import configure_logging
from recship.names import LOG_FORMATS
from recship.serving.settings import SERVER_FIELDS, ServerConfig, flag_of, megabytes

log = logging.getLogger("recship.serving")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``recship serve``'s flags: ServerConfig's fields (serving/settings.py), with --config and --log-format."""
    parser.add_argument("--config", help="YAML or JSON file of these flags (keys as the flags, `max-batch-size` or "
                                         "`max_batch_size`); flags given on the command line override it (default: none)")
    for f in SERVER_FIELDS.values():
        if not f.metadata["help"]:
            continue  # a setting of the Python API only
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        kw: Dict[str, Any] = {}
        said = ""
        if default is dataclasses.MISSING:
            kw["required"] = True
            said = "required"
        elif isinstance(default, bool):
            kw.update(action=argparse.BooleanOptionalAction, default=default)
            said = "default on" if default else "default off"
        elif isinstance(default, list):
            kw.update(action="append", default=[], metavar="NAME")
        elif f.metadata["megabytes_below"]:
            kw.update(type=float, default=default / 2**20, metavar="MB")
            said = f"default {default / 2**20:g} MB"
        else:
            check = f.metadata["range"]
            kw.update(default=default, type=str if check is None else int if check.integer else float)
            if f.metadata["choices"] is not None:
                kw["choices"] = list(f.metadata["choices"])
            said = f"default {default:g}" if isinstance(default, float) else f"default {default}"
        if f.metadata["default_text"]:
            said = f"default: {f.metadata['default_text']}"
        parser.add_argument(flag_of(f), help=f"{f.metadata['help']} ({said})", **kw)
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text: time, level, logger and message; json: one JSON object per line, for log collectors "
                             "(the deploy/ manifests pass it) (default text, as every recship command)")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed ``recship serve`` arguments (a --config file's values are already in them)."""
    values: Dict[str, Any] = {}
    for f in SERVER_FIELDS.values():
        if f.metadata["help"]:
            value = getattr(args, flag_of(f)[2:].replace("-", "_"))
            if f.metadata["megabytes_below"]:
                value = megabytes(flag_of(f), value, below=f.metadata["megabytes_below"])
            values[f.name] = list(value) if isinstance(value, list) else value
    return ServerConfig(**values)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)  # first: importing torch and fbgemm below warns, in this format
    from recship.serving.server import Server  # lazy: `recship serve --help` stays torch-free

    server = Server(config_from_args(args))  # a port in use, an unreadable file: recship.cli says the OSError in one line
    done, stopping = threading.Event(), threading.Event()

    def shutdown(signum, frame):
        log.info("signal %d: draining and stopping", signum)
        if not stopping.is_set():  # a second signal changes nothing: the drain goes on
            stopping.set()
            threading.Thread(target=lambda: (server.stop(drain_delay=server.config.drain_delay_s), done.set()), daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    rest = f", KServe REST on {args.host}:{server.rest.port}" if server.rest else ""
    print(f"recship serve: listening on {args.host}:{server.port}{rest}", flush=True)
    done.wait()
    # Stopped: every listener closed, the front gone, the temp folders removed. The interpreter's own teardown
    # (torch's and gRPC's destructors, module by module) took 1 to 3 s more, past what --drain-delay promises:
    # the process ends here, its exit handlers run (the temp folder's removal) and its logs and output flushed.
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
