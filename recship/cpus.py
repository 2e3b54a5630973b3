"""How many CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota.

``os.cpu_count()`` counts the host's cores: a pod limited to ``cpu: "2"`` on a 64-core node would
start 63 forward threads that the kernel then throttles to two cores' worth of time. Kubernetes
(and docker ``--cpus``) set the limit as a CFS quota: cgroup v2 ``cpu.max`` ("200000 100000" is
2 CPUs, "max 100000" none), cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none).
``taskset`` / cpusets narrow the affinity mask instead. A fractional quota rounds up (1.5 CPUs: 2
threads, the second one half-idle, rather than one thread that leaves half a CPU unused).
"""

import math
import os
from pathlib import Path
from typing import Optional

CGROUP_ROOT = "/sys/fs/cgroup"


def usable_cpus(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> int:
    """CPUs this process may use (>= 1): the affinity mask's size, capped by the cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def cgroup_cpu_quota(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> Optional[float]:
    """The CPU quota (in CPUs) of this process's cgroup and its parents, the smallest one; None without a limit."""
    root = Path(cgroup_root)
    limits = []
    for folder in _cgroup_folders(root, proc_cgroup):
        v2 = _read(folder / "cpu.max")
        if v2 is not None:
            parts = v2.split()
            if len(parts) == 2 and parts[0] != "max" and _positive(parts[0]) and _positive(parts[1]):
                limits.append(int(parts[0]) / int(parts[1]))
            continue
        quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota is not None and period is not None and _positive(quota) and _positive(period):
            limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def _cgroup_folders(root: Path, proc_cgroup: str):
    """The folders that may hold this process's CPU limit: its own cgroup's and each parent's, up to the root (v2's
    unified hierarchy; v1's ``cpu`` controller, mounted as cpu/ or cpu,cpuacct/). Inside a container the
    namespace makes its cgroup the root, so the root itself is always looked at."""
    paths = {"": "/"}  # controller ("" for v2) -> the process's path in it
    text = _read(Path(proc_cgroup))
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths.setdefault(controller, parts[2])
            if parts[1] == "":
                paths[""] = parts[2]
    seen = set()
    for base, path in ((root, paths[""]), (root / "cpu", paths.get("cpu", "/")), (root / "cpu,cpuacct", paths.get("cpu", "/"))):
        parts = [p for p in path.split("/") if p and p != ".."]
        for depth in range(len(parts), -1, -1):
            folder = base.joinpath(*parts[:depth])
            if folder not in seen:
                seen.add(folder)
                yield folder


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _positive(text: str) -> bool:
    return text.isdigit() and int(text) > 0
