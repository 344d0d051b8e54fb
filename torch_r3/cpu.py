"""How many CPUs this process may really use, inside a container.

`os.cpu_count()` reports the host's CPUs. A container is limited twice over:
by its affinity mask (cpusets) and by its CFS bandwidth quota (`docker run
--cpus=1.5`), which the kernel only exposes through cgroup files. Sizing a
thread pool from the host count oversubscribes the quota and the pool gets
throttled, so every pool in torch_r3 is sized from `usable_cpus`.

Every function that reads cgroup files takes `root`, the file-system root to read `/proc` and
`/sys/fs/cgroup` under, so that tests can build fake trees.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch_r3._checks import check_non_negative, check_positive

__all__ = [
    "DEFAULT_POOL_CAP",
    "ENV_NUM_WORKERS",
    "MAX_WORKERS",
    "CgroupQuota",
    "affinity_cpus",
    "cgroup_cpu_limit",
    "cgroup_memory_room",
    "cgroup_quotas",
    "loadavg_1min",
    "pool_workers",
    "usable_cpus",
]

#: Environment variable that overrides `pool_workers`.
ENV_NUM_WORKERS = "TORCH_R3_NUM_WORKERS"
#: The most copy threads a collation may use, `TORCH_R3_NUM_WORKERS` included.
#: Copies are bound by memory bandwidth, which a few threads per socket
#: saturate; beyond this, threads only contend.
MAX_WORKERS = 64
#: Past about 8 threads, first-touch page faults of a fresh output buffer contend
#: on the kernel's memory-map lock and the pool gets slower, not faster.
DEFAULT_POOL_CAP = 8


@dataclass(frozen=True)
class CgroupQuota:
    """One CPU quota found on the path from this process's cgroup to its mount root."""

    path: str  # the cgroup directory, as seen under `root`
    version: int  # 1 or 2
    cpus: float  # quota / period


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (`os.cpu_count()` where the OS has none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def _self_cgroups(root: Path) -> tuple[str | None, dict[str, str]]:
    """(v2 path, {v1 controller: path}) from `/proc/self/cgroup`."""
    text = _read(root / "proc/self/cgroup") or ""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        else:
            for c in controllers.split(","):
                v1[c] = path
    return v2, v1


def _cgroup_mounts(root: Path) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount root, mount point, super options) of every cgroup mount."""
    mounts = []
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        try:
            sep = fields.index("-")
            mount_root, mount_point = _unescape(fields[3]), _unescape(fields[4])
            fstype, super_opts = fields[sep + 1], fields[sep + 3]
        except (ValueError, IndexError):
            continue
        if fstype in ("cgroup", "cgroup2"):
            mounts.append((fstype, mount_root, mount_point, set(super_opts.split(","))))
    return mounts


def _relative(path: str, mount_root: str) -> str | None:
    """`path` relative to `mount_root` (both absolute cgroup paths), or None if outside."""
    path, mount_root = path.rstrip("/") or "/", mount_root.rstrip("/") or "/"
    if mount_root == "/":
        return path.lstrip("/")
    if path == mount_root:
        return ""
    if path.startswith(mount_root + "/"):
        return path[len(mount_root) + 1 :]
    return None


def _walk_up(root: Path, mount_point: str, rel: str):
    """Directories from the process's cgroup up to the mount point, inclusive."""
    base = root / mount_point.lstrip("/")
    parts = [p for p in rel.split("/") if p]
    for n in range(len(parts), -1, -1):
        yield base.joinpath(*parts[:n])


def _v2_quota(directory: Path) -> float | None:
    text = _read(directory / "cpu.max")
    if text is None:
        return None
    fields = text.split()
    if len(fields) not in (1, 2) or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) == 2 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(directory: Path) -> float | None:
    quota_text = _read(directory / "cpu.cfs_quota_us")
    period_text = _read(directory / "cpu.cfs_period_us")
    if quota_text is None or period_text is None:
        return None
    try:
        quota, period = int(quota_text.strip()), int(period_text.strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _cgroup_dirs(root: Path, controller: str):
    """(version, directory) of this process's cgroup for `controller`, leaf first, up to each mount root.

    cgroup v2 contributes its unified hierarchy, v1 the hierarchy that mounts
    `controller`; a hybrid host contributes both. Falls back to the
    conventional `/sys/fs/cgroup` layout when `mountinfo` names no cgroup mount.
    """
    v2_path, v1_paths = _self_cgroups(root)
    mounts = _cgroup_mounts(root)
    if not mounts:  # no mountinfo: assume the conventional layout
        mounts = [("cgroup2", "/", "/sys/fs/cgroup", set())]
        for name in (f"{controller},cpuacct", controller) if controller == "cpu" else (controller,):
            mounts.append(("cgroup", "/", f"/sys/fs/cgroup/{name}", {controller}))
    seen: set[Path] = set()
    for fstype, mount_root, mount_point, opts in mounts:
        if fstype == "cgroup2":
            version, path = 2, v2_path
        elif controller in opts:
            version, path = 1, v1_paths.get(controller)
        else:
            continue
        rel = None if path is None else _relative(path, mount_root)
        if rel is None:
            continue
        for directory in _walk_up(root, mount_point, rel):
            if directory not in seen:
                seen.add(directory)
                yield version, directory


def _shown(root: Path, directory: Path) -> str:
    return "/" + str(directory.relative_to(root)) if directory != root else "/"


def cgroup_quotas(root: str | os.PathLike = "/") -> list[CgroupQuota]:
    """Every CPU quota on the path from this process's cgroup(s) up to the mount root.

    Reads `/proc/self/cgroup` and `/proc/self/mountinfo` under `root` to
    find the process's own cgroup directory for cgroup v2 (`cpu.max`) and for
    v1's `cpu` controller (`cpu.cfs_quota_us` / `cpu.cfs_period_us`); a
    hybrid host contributes both. Falls back to `/sys/fs/cgroup` when
    `mountinfo` names no cgroup mount. Unreadable or malformed files are
    skipped, never raised.
    """
    root = Path(root)
    found: list[CgroupQuota] = []
    for version, directory in _cgroup_dirs(root, "cpu"):
        cpus = (_v2_quota if version == 2 else _v1_quota)(directory)
        if cpus is not None:
            found.append(CgroupQuota(path=_shown(root, directory), version=version, cpus=cpus))
    return found


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def cgroup_memory_room(root: str | os.PathLike = "/") -> tuple[int | None, str | None]:
    """Bytes this process's cgroups still allow it to allocate, and the binding cgroup.

    The smallest `limit - usage` along the path from the process's memory
    cgroup up to the mount root, over v2 (`memory.max`/`memory.current`)
    and v1 (`memory.limit_in_bytes`/`memory.usage_in_bytes`);
    `(None, None)` when no limit is set or readable.
    """
    root = Path(root)
    best: tuple[int | None, str | None] = (None, None)
    for version, directory in _cgroup_dirs(root, "memory"):
        limit_file, usage_file = (
            ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        )
        limit = _read_int(directory / limit_file)
        if limit is None or limit >= 1 << 60:  # "max", or v1's "unlimited" (2**63 rounded to a page)
            continue
        room = limit - (_read_int(directory / usage_file) or 0)
        if best[0] is None or room < best[0]:
            best = (room, _shown(root, directory))
    return best


def cgroup_cpu_limit(root: str | os.PathLike = "/") -> float | None:
    """The CPU quota that binds this process, e.g. `1.5`; `None` when unlimited or unknown.

    The smallest quota along the path from the process's cgroup up to the
    mount root (a parent's quota caps its children), over cgroup v2 and v1.
    """
    return _binding_limit(cgroup_quotas(root))


def _binding_limit(quotas: list[CgroupQuota]) -> float | None:
    return min(q.cpus for q in quotas) if quotas else None


def _usable(affinity: int, limit: float | None) -> float:
    return min(float(affinity), limit) if limit is not None else float(affinity)


def usable_cpus(root: str | os.PathLike = "/") -> float:
    """CPUs this process may really use: min(affinity mask, cgroup quota).

    A float, since a quota may be fractional (`--cpus=1.5` gives `1.5`).
    """
    return _usable(affinity_cpus(), cgroup_cpu_limit(root))


def pool_workers(
    cap: int = DEFAULT_POOL_CAP,
    reserve: int = 0,
    *,
    root: str | os.PathLike = "/",
    usable: float | None = None,
    share: int = 1,
) -> int:
    """Threads for a copy pool: `max(1, min(cap, floor(usable_cpus() / share) - reserve))`.

    `TORCH_R3_NUM_WORKERS` (an integer from 1 to `MAX_WORKERS`) overrides the computation.
    One worker means the kernel runs serially on the calling thread. `usable`
    is `usable_cpus(root)` when the caller has already read it; `share` is how
    many processes split the CPUs (a `DataLoader`'s `num_workers`, inside one).
    """
    env = os.environ.get(ENV_NUM_WORKERS)
    if env is not None and env.strip():
        try:
            value = int(env)
        except ValueError:
            value = 0
        if not 1 <= value <= MAX_WORKERS:
            raise ValueError(
                f"{ENV_NUM_WORKERS} must be an integer from 1 to {MAX_WORKERS} (collation threads), got {env!r}; "
                f"unset it for the default"
            )
        return value
    cap, reserve, share = (
        check_positive(cap, "cap"),
        check_non_negative(reserve, "reserve"),
        check_positive(share, "share"),
    )
    usable = usable_cpus(root) if usable is None else usable
    return max(1, min(cap, math.floor(usable / share) - reserve))


def cpu_topology() -> dict[str, Any]:
    """The CPU topology the collation pool sees, as `torch-r3 doctor` and `torch-r3 bench` show it.

    Returns:
        A JSON-serialisable dict: `affinity_cpus`, `os_cpu_count`, `cgroup_quotas`,
        `cgroup_cpu_limit`, `usable_cpus`, `pool_workers` (`None` with `pool_workers_error`
        when `TORCH_R3_NUM_WORKERS` is malformed), the `TORCH_R3_NUM_WORKERS`
        and `OMP_NUM_THREADS` settings, `torch_num_threads` and `loadavg_1min`.

    Examples:
        >>> topology = cpu_topology()
        >>> topology["pool_workers"] >= 1 and topology["usable_cpus"] <= topology["affinity_cpus"]
        True
    """
    import torch  # lazy: the rest of this module is pure standard library

    # One reading of the affinity mask and the cgroup tree, so every figure comes from the same moment.
    affinity, quotas = affinity_cpus(), cgroup_quotas()
    limit = _binding_limit(quotas)
    usable = _usable(affinity, limit)
    try:
        workers: int | None = pool_workers(usable=usable)
        workers_error = None
    except ValueError as e:  # a malformed TORCH_R3_NUM_WORKERS: report it rather than fail the report
        workers, workers_error = None, str(e)
    return {
        "affinity_cpus": affinity,
        "os_cpu_count": os.cpu_count(),
        "cgroup_quotas": [asdict(q) for q in quotas],
        "cgroup_cpu_limit": limit,
        "usable_cpus": usable,
        "pool_workers": workers,
        "pool_workers_error": workers_error,
        ENV_NUM_WORKERS: os.environ.get(ENV_NUM_WORKERS),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch_num_threads": torch.get_num_threads(),
        # Other work on the machine shows up here: a pool cannot speed up on
        # CPUs that someone else is using, and OpenMP code degrades sharply.
        "loadavg_1min": loadavg_1min(),
    }


def loadavg_1min() -> float | None:
    """The 1-minute load average, or `None` where the OS has none or will not give it (some sandboxes)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
