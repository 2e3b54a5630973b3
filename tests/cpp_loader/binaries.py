"""Running the C++ loader's programs in tests: one helper for every file that calls recship_predict (or another of
cpp_loader's binaries) with arguments and reads its exit status, stdout and stderr."""

import subprocess
from typing import Any, Dict, Optional


def run_binary(binary: Any, *args: Any, env: Optional[Dict[str, str]] = None, timeout: float = 300) -> "subprocess.CompletedProcess[str]":
    """``binary args...`` to completion (its output as text; bytes that are not UTF-8 replaced, as a refusal may quote
    them); a run past ``timeout`` seconds fails the test with subprocess.TimeoutExpired."""
    return subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, errors="replace", env=env,
                          timeout=timeout)
