"""`torch-r3 doctor`: what a bug report about torch_r3 needs, and what to fix.

`doctor_report` gathers the versions, the accelerator and its pinned memory,
and the CPUs the collation pool sees; `format_doctor` turns it into the text
the command prints. The command line (`torch_r3.cli`) only parses and
dispatches.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["doctor_report", "fatal_problem", "format_doctor"]


# The distributions whose versions matter to a bug report, in report order: the core, then
# the extras (each hook's framework, Ray, the client's aiohttp and pybase64).
_DISTRIBUTIONS = ("torch_r3", "torch", "numpy", "megatron-core", "transformers", "ray", "aiohttp", "pybase64")


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _accelerator() -> dict[str, Any]:
    import torch

    from torch_r3.collate._memory import accelerator_available

    available = accelerator_available()
    current = torch.accelerator.current_accelerator() if available and hasattr(torch, "accelerator") else None
    devices: list[str] = []
    if available and torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    pinned, pinned_note = _pinned_memory(available)
    return {
        "available": available,
        "type": None if current is None else current.type,
        "devices": devices,
        "cuda_build": torch.version.cuda,
        "hip_build": torch.version.hip,
        "pinned_memory": pinned,
        "pinned_memory_note": pinned_note,
    }


def _pinned_memory(accelerator: bool) -> tuple[bool, str]:
    import torch

    if not accelerator:
        return False, "no accelerator: collate_routes uses plain memory (pinning would not help)"
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError as e:
        return False, f"accelerator present but pinning failed: {e}"
    return True, "available: collate_routes pins its outputs in the main process"


def _wire() -> dict[str, Any]:
    from torch_r3.rollout import _base64, _json

    return {"decoder": _base64.decoder(), "note": _base64.describe_decoder(), "json": _json.describe_parser()}


def _cpu() -> dict[str, Any]:
    import torch

    from torch_r3.cpu import cpu_topology

    return {**cpu_topology(), "torch_interop_threads": torch.get_num_interop_threads()}


def _warnings(accelerator: dict[str, Any], cpus: dict[str, Any]) -> list[str]:
    """Only what needs fixing: a set-up with no quota and default settings gets none."""
    from torch_r3.cpu import DEFAULT_POOL_CAP, ENV_NUM_WORKERS

    usable = cpus["usable_cpus"]
    fit = max(1, math.floor(usable))
    out = []
    if cpus["torch_num_threads"] > usable:
        # torch sizes its pool from the affinity mask; a CFS quota below it throttles every op.
        out.append(
            f"torch runs {cpus['torch_num_threads']} intra-op threads on {usable:g} usable CPUs: the "
            f"threads are throttled; set OMP_NUM_THREADS={fit} (or torch.set_num_threads({fit}))"
        )
    if cpus["pool_workers_error"]:
        out.append(cpus["pool_workers_error"])
    elif cpus[ENV_NUM_WORKERS] and cpus["pool_workers"] > usable:
        out.append(
            f"{ENV_NUM_WORKERS}={cpus[ENV_NUM_WORKERS]} asks for more collation threads than the "
            f"{usable:g} usable CPUs: unset it (the default is min({DEFAULT_POOL_CAP}, {fit})) or lower it"
        )
    if accelerator["available"] and not accelerator["pinned_memory"]:
        out.append(accelerator["pinned_memory_note"])
    return out


def doctor_report() -> dict[str, Any]:
    """What `torch-r3 doctor` reports, as a dict that `json.dumps` accepts.

    Returns:
        `versions` (distribution -> version, `None` when not installed; plus `python`
        and `platform`), `wire` (the base64 decoder the wire codec uses: `decoder`,
        `"pybase64"`, `"binascii"` or `"reference"`, and a one-line `note`),
        `accelerator` (availability, devices, CUDA/HIP build, pinned
        memory), `cpu` (affinity mask, cgroup quotas, usable CPUs, pool workers, thread
        settings), `memory` (the transparent-hugepage mode, `None` when unknown, and the
        hugepage size) and `warnings` (what to fix; empty on a set-up that needs nothing).
    """
    import platform

    versions: dict[str, str | None] = {"python": platform.python_version(), "platform": platform.platform()}
    versions.update({name: _version(name) for name in _DISTRIBUTIONS})
    # The code this process runs, not what an editable install's metadata said when it was made.
    from torch_r3 import __version__

    versions["torch_r3"] = __version__
    accelerator = _accelerator()
    cpus = _cpu()
    return {
        "versions": versions,
        "wire": _wire(),
        "accelerator": accelerator,
        "cpu": cpus,
        "memory": _memory_report(),
        "warnings": _warnings(accelerator, cpus),
    }


def _memory_report() -> dict[str, Any]:
    from torch_r3.collate._memory import hugepage_size, read_thp_mode

    mode = read_thp_mode()
    if mode in ("madvise", "always"):
        note = "fresh outputs are hugepage-advised: one page fault per hugepage instead of per 4 KiB page"
    elif mode == "never":
        note = (
            "off: a fresh output pays a first-touch fault per 4 KiB page (recycled outputs, the default, do not); "
            "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled turns them on"
        )
    else:
        note = "unknown (no /sys/kernel/mm/transparent_hugepage/enabled): outputs use the OS's default pages"
    return {"transparent_hugepages": mode, "hugepage_bytes": hugepage_size(), "transparent_hugepages_note": note}


def fatal_problem(report: dict[str, Any]) -> str | None:
    """What in `report` makes every collation fail (`torch-r3 doctor` then exits 1), or None."""
    error = report["cpu"]["pool_workers_error"]
    return f"every collator call would fail: {error}" if error else None


def format_doctor(r: dict[str, Any]) -> str:
    """The report of `doctor_report` as the text `torch-r3 doctor` prints."""
    from torch_r3.cpu import DEFAULT_POOL_CAP, ENV_NUM_WORKERS

    def row(name: str, value: object) -> str:
        return f"  {name:<20} {value}"

    acc, cpus = r["accelerator"], r["cpu"]
    lines = ["versions"] + [row(k, v or "not installed") for k, v in r["versions"].items()]
    lines += [
        "wire codec (routes off the HTTP body)",
        row("base64 decoder", r["wire"]["note"]),
        row("JSON parser", r["wire"]["json"]),
    ]
    build = ", ".join(f"{k} {v}" for k, v in (("CUDA", acc["cuda_build"]), ("HIP", acc["hip_build"])) if v)
    lines += [
        "accelerator",
        row(
            "available",
            f"yes ({acc['type']}: {', '.join(acc['devices']) or 'no device names'})" if acc["available"] else "no",
        ),
        row("torch built with", build or "no CUDA or HIP (CPU build)"),
        row("pinned memory", f"{'yes' if acc['pinned_memory'] else 'no'}: {acc['pinned_memory_note']}"),
        "CPU (what the collation pool sees)",
        row("affinity mask", f"{cpus['affinity_cpus']} CPUs (os.cpu_count() = {cpus['os_cpu_count']})"),
    ]
    for q in cpus["cgroup_quotas"]:
        lines.append(row(f"cgroup v{q['version']} quota", f"{q['cpus']:g} CPUs at {q['path']}"))
    if not cpus["cgroup_quotas"]:
        lines.append(row("cgroup quota", "none found (no cpu.max / cpu.cfs_quota_us limit on this cgroup path)"))
    workers = cpus["pool_workers"]
    source = (
        f"from {ENV_NUM_WORKERS}={cpus[ENV_NUM_WORKERS]}"
        if cpus[ENV_NUM_WORKERS]
        else f"min({DEFAULT_POOL_CAP}, floor(usable CPUs))"
    )
    lines += [
        row("usable CPUs", f"{cpus['usable_cpus']:g} (min of affinity mask and cgroup quota)"),
        row("pool workers", f"{workers} ({source})" if workers is not None else f"invalid ({source})"),
        row(
            "torch threads",
            f"{cpus['torch_num_threads']} intra-op, {cpus['torch_interop_threads']} inter-op "
            f"(OMP_NUM_THREADS={cpus['OMP_NUM_THREADS'] or 'unset'})",
        ),
    ]
    mem = r["memory"]
    lines += [
        "memory (where collated outputs live)",
        row("hugepages (THP)", f"{mem['transparent_hugepages'] or 'unknown'}: {mem['transparent_hugepages_note']}"),
    ]
    lines += [f"warning: {w}" for w in r["warnings"]] or ["ok: nothing to fix"]
    return "\n".join(lines)
