"""torch_r3.cpu against fake /proc and /sys/fs/cgroup trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torch_r3 import cpu

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


@pytest.fixture
def affinity(monkeypatch):
    def set_cpus(n):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)

    set_cpus(16)
    monkeypatch.delenv(cpu.ENV_NUM_WORKERS, raising=False)
    return set_cpus


def test_a_v2_quota_at_the_root_cgroup_limits_usable_cpus(tmp_path, affinity):
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    write(tmp_path, "sys/fs/cgroup/cpu.max", "150000 100000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) == 1.5
    assert cpu.usable_cpus(tmp_path) == 1.5
    assert cpu.pool_workers(root=tmp_path) == 1


def test_nested_v2_quotas_take_the_smallest_on_the_path_to_the_root(tmp_path, affinity):
    write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n")
    write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    write(tmp_path, "sys/fs/cgroup/cpu.max", "max 100000\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/cpu.max", "800000 100000\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/pod1/cpu.max", "300000 100000\n")  # the binding one
    write(tmp_path, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n")
    # A sibling's quota is not on the path and must be ignored.
    write(tmp_path, "sys/fs/cgroup/kubepods/pod2/cpu.max", "10000 100000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) == 3.0
    assert cpu.pool_workers(root=tmp_path) == 3
    assert [q.path for q in cpu.cgroup_quotas(tmp_path)] == ["/sys/fs/cgroup/kubepods/pod1", "/sys/fs/cgroup/kubepods"]


def test_a_v2_quota_is_found_under_a_namespaced_mount_root(tmp_path, affinity):
    # Inside a cgroup namespace the mount root is the container's cgroup.
    write(tmp_path, "proc/self/cgroup", "0::/docker/abc/inner\n")
    write(tmp_path, "proc/self/mountinfo", "30 23 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "200000 100000\n")
    write(tmp_path, "sys/fs/cgroup/inner/cpu.max", "250000 100000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) == 2.0


def test_an_unlimited_v2_quota_means_no_limit(tmp_path, affinity):
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    write(tmp_path, "sys/fs/cgroup/cpu.max", "max 100000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) is None
    assert cpu.usable_cpus(tmp_path) == 16
    assert cpu.pool_workers(root=tmp_path) == cpu.DEFAULT_POOL_CAP


def test_a_v1_cfs_quota_limits_usable_cpus(tmp_path, affinity):
    write(tmp_path, "proc/self/cgroup", "5:memory:/x\n4:cpu,cpuacct:/docker/abc\n")
    write(
        tmp_path, "proc/self/mountinfo", "40 31 0:37 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
    )
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) == 2.5
    assert cpu.pool_workers(root=tmp_path) == 2
    assert cpu.pool_workers(reserve=1, root=tmp_path) == 1


def test_a_hybrid_host_reports_both_v1_and_v2_quotas(tmp_path, affinity):
    write(tmp_path, "proc/self/cgroup", "0::/user.slice\n3:cpu:/batch\n")
    write(
        tmp_path,
        "proc/self/mountinfo",
        "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
        "33 31 0:30 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
    )
    write(tmp_path, "sys/fs/cgroup/cpu/batch/cpu.cfs_quota_us", "50000\n")
    write(tmp_path, "sys/fs/cgroup/cpu/batch/cpu.cfs_period_us", "100000\n")
    # The v2 hierarchy has no cpu controller here: no cpu.max file at all.
    (tmp_path / "sys/fs/cgroup/unified/user.slice").mkdir(parents=True)
    assert cpu.cgroup_cpu_limit(tmp_path) == 0.5
    assert cpu.usable_cpus(tmp_path) == 0.5
    assert cpu.pool_workers(root=tmp_path) == 1


def test_an_escaped_mount_point_in_mountinfo_is_unescaped(tmp_path, affinity):
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "proc/self/mountinfo", "30 23 0:26 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n")
    write(tmp_path, "sys/fs/my cgroup/cpu.max", "100000 100000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) == 1.0


def test_without_mountinfo_the_conventional_mount_is_read(tmp_path, affinity):
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "400000 100000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) == 4.0


@pytest.mark.parametrize(
    "content",
    ["", "garbage\n", "abc 100000\n", "100000 0\n", "-5 100000\n", "1 2 3\n", "\xff\xfe"],
)
def test_a_garbage_cpu_max_means_no_limit_is_known(tmp_path, affinity, content):
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cpu.max").write_bytes(content.encode("latin-1"))
    assert cpu.cgroup_cpu_limit(tmp_path) is None


def test_garbage_proc_files_and_a_missing_tree_mean_no_limit(tmp_path, affinity):
    assert cpu.cgroup_cpu_limit(tmp_path) is None  # nothing at all
    write(tmp_path, "proc/self/cgroup", "nonsense\n::\n7\n")
    write(tmp_path, "proc/self/mountinfo", "half a line\n1 2 3 - \n")
    assert cpu.cgroup_cpu_limit(tmp_path) is None
    assert cpu.usable_cpus(tmp_path) == 16


def test_a_v1_quota_without_period_or_with_garbage_means_no_limit(tmp_path, affinity):
    write(tmp_path, "proc/self/cgroup", "4:cpu:/\n")
    write(tmp_path, "proc/self/mountinfo", "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "50000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) is None
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_period_us", "x\n")
    assert cpu.cgroup_cpu_limit(tmp_path) is None


def test_an_unreadable_quota_file_means_no_limit(tmp_path, affinity):
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    (tmp_path / "sys/fs/cgroup/cpu.max").mkdir(parents=True)  # a directory: read fails with OSError
    assert cpu.cgroup_cpu_limit(tmp_path) is None


def test_the_affinity_mask_limits_usable_cpus(tmp_path, affinity):
    affinity(3)
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    write(tmp_path, "sys/fs/cgroup/cpu.max", "800000 100000\n")
    assert cpu.usable_cpus(tmp_path) == 3
    assert cpu.pool_workers(root=tmp_path) == 3
    assert cpu.pool_workers(cap=2, root=tmp_path) == 2
    assert cpu.pool_workers(reserve=5, root=tmp_path) == 1


def test_processes_sharing_the_cpus_each_get_their_share_of_workers(tmp_path, affinity):
    affinity(7)  # e.g. inside one of 2 or 3 DataLoader workers
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    assert [cpu.pool_workers(share=n, root=tmp_path) for n in (1, 2, 3, 8)] == [7, 3, 2, 1]
    with pytest.raises(ValueError, match="share must be >= 1, got 0"):  # the one wording of _checks
        cpu.pool_workers(share=0, root=tmp_path)


@pytest.mark.parametrize("error", [AttributeError, OSError])
def test_affinity_falls_back_to_cpu_count_where_the_os_has_none(monkeypatch, error):
    def broken(pid):
        raise error("no affinity here")

    monkeypatch.setattr(os, "sched_getaffinity", broken, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    assert cpu.affinity_cpus() == 5


def test_the_environment_overrides_pool_workers(tmp_path, affinity, monkeypatch):
    monkeypatch.setenv(cpu.ENV_NUM_WORKERS, "5")
    assert cpu.pool_workers(root=tmp_path) == 5
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv(cpu.ENV_NUM_WORKERS, bad)
        with pytest.raises(ValueError, match=cpu.ENV_NUM_WORKERS):
            cpu.pool_workers(root=tmp_path)


def test_pool_workers_refuses_bad_arguments(tmp_path, affinity):
    with pytest.raises(TypeError, match="cap must be an int"):
        cpu.pool_workers(cap=2.5, root=tmp_path)
    with pytest.raises(ValueError, match="cap must be >= 1, got 0"):  # the one wording of _checks
        cpu.pool_workers(cap=0, root=tmp_path)


def test_the_real_machine_s_figures_are_consistent():
    # Whatever this machine is, the pieces agree with each other.
    usable = cpu.usable_cpus()
    assert 0 < usable <= (os.cpu_count() or 1)
    limit = cpu.cgroup_cpu_limit()
    assert limit is None or usable <= limit


def test_memory_room_v2_takes_the_tightest_cgroup_on_the_path(tmp_path):
    write(tmp_path, "proc/self/cgroup", "0::/a/b\n")
    write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/a/memory.max", str(8 << 30) + "\n")
    write(tmp_path, "sys/fs/cgroup/a/memory.current", str(7 << 30) + "\n")  # 1 GiB left here
    write(tmp_path, "sys/fs/cgroup/a/b/memory.max", str(4 << 30) + "\n")
    write(tmp_path, "sys/fs/cgroup/a/b/memory.current", str(1 << 30) + "\n")  # 3 GiB left
    assert cpu.cgroup_memory_room(tmp_path) == (1 << 30, "/sys/fs/cgroup/a")


def test_memory_room_reads_v1_limits_and_ignores_unlimited_ones(tmp_path):
    write(tmp_path, "proc/self/cgroup", "6:memory:/job\n")
    write(tmp_path, "proc/self/mountinfo", "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", str(2**63 - 4096) + "\n")  # v1 "unlimited"
    assert cpu.cgroup_memory_room(tmp_path) == (None, None)
    write(tmp_path, "sys/fs/cgroup/memory/job/memory.limit_in_bytes", str(2 << 30) + "\n")
    write(tmp_path, "sys/fs/cgroup/memory/job/memory.usage_in_bytes", "garbage\n")  # unknown usage counts as 0
    assert cpu.cgroup_memory_room(tmp_path) == (2 << 30, "/sys/fs/cgroup/memory/job")


def test_cpu_topology_reports_what_the_pool_sees(monkeypatch):
    monkeypatch.setenv(cpu.ENV_NUM_WORKERS, "3")
    topology = cpu.cpu_topology()
    assert topology["pool_workers"] == 3 and topology[cpu.ENV_NUM_WORKERS] == "3"
    assert topology["usable_cpus"] == cpu.usable_cpus() and topology["affinity_cpus"] == cpu.affinity_cpus()
