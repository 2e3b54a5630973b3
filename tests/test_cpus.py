"""The CPUs a process may use: the affinity mask capped by its cgroup's CPU quota (recship/cpus.py), on fake cgroup
trees laid out as cgroup v2 and v1 mount them, and the server's default forward threads that follow from it."""

import os

import pytest

from recship import cpus
from recship.cpus import cgroup_cpu_quota, usable_cpus


def _tree(tmp_path, files, proc="0::/\n"):
    for name, text in files.items():
        path = tmp_path / "cg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "proc").write_text(proc)
    return str(tmp_path / "cg"), str(tmp_path / "proc")


@pytest.mark.parametrize("files,proc,quota", [
    ({"cpu.max": "200000 100000\n"}, "0::/\n", 2.0),                                       # a pod with cpu: "2"
    ({"cpu.max": "max 100000\n"}, "0::/\n", None),                                          # no limit
    ({"cpu.max": "150000 100000\n"}, "0::/\n", 1.5),
    ({"kubepods/pod1/cpu.max": "50000 100000\n", "kubepods/cpu.max": "800000 100000\n"},   # the tightest of the path
     "0::/kubepods/pod1\n", 0.5),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, "4:cpu,cpuacct:/\n", 3.0),  # v1
    ({"cpu/docker/x/cpu.cfs_quota_us": "-1\n", "cpu/docker/x/cpu.cfs_period_us": "100000\n"}, "4:cpu,cpuacct:/docker/x\n", None),
    ({}, "0::/\n", None),                                                                    # no cgroup files at all
])
def test_the_quota_is_read_as_cgroup_v2_and_v1_write_it(tmp_path, files, proc, quota):
    root, proc_file = _tree(tmp_path, files, proc)
    assert cgroup_cpu_quota(root, proc_file) == quota


def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_up(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    for text, want in [("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 1), ("max 100000", 64)]:
        root, proc_file = _tree(tmp_path, {"cpu.max": text})
        assert usable_cpus(root, proc_file) == want, text
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5, 7})  # taskset narrower than the quota
    root, proc_file = _tree(tmp_path, {"cpu.max": "800000 100000"})
    assert usable_cpus(root, proc_file) == 3


@pytest.mark.parametrize("cores,threads", [(1, 1), (2, 2), (3, 2), (8, 7)])
def test_the_servers_forward_threads_follow_the_usable_cpus(monkeypatch, cores, threads):
    from recship.serving import settings

    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the host's cores do not count
    monkeypatch.setattr(settings, "usable_cpus", lambda *a, **k: cores)  # the name settings calls
    assert settings.default_torch_threads() == threads


def test_this_machine_reads_without_error():
    n = usable_cpus()
    assert 1 <= n <= (os.cpu_count() or 1)
