"""How much host memory the cache may hold: `host_memory_limit` reads what this process can
use at most (the machine's physical memory, or its control group's limit where that is
lower: a container's), and `footprint` says what a host tensor of some bytes holds there.

Linux lends a process more pageable memory than it has (overcommit) and touches it page by
page: a pool larger than the host allocates fine and is killed for memory hours later, once
the engine has used enough of its slots. `CacheConfig.host_budget_bytes` (default: this
limit) refuses such a key at its first save instead (`host_budget.HostBudget`).
"""

from __future__ import annotations

import os
from pathlib import Path


def physical_memory() -> int | None:
    """The machine's physical memory in bytes, ``None`` where the OS does not say."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # (no sysconf, or no such name on this OS)
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def cgroup_memory_limit(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The tightest memory limit of this process's control group and the groups above it
    (cgroup v2 ``memory.max``; v1 ``memory.limit_in_bytes``), ``None`` when none is set or
    none can be read. A group path the process's namespace does not show is skipped."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: "0::/the/group"
            base, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):  # v1: "N:memory:/the/group"
            base, name = cgroup_root / "memory", "memory.limit_in_bytes"
        else:
            continue
        if ".." in Path(path).parts:  # (a group outside this process's cgroup namespace)
            continue
        group = base / path.lstrip("/")
        while True:  # (the group and each ancestor up to the hierarchy's root)
            limit = _read_limit(group / name)
            if limit is not None:
                limits.append(limit)
            if group == base or base not in group.parents:
                break
            group = group.parent
    return min(limits, default=None)


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # ("max": no limit)


def host_memory_limit() -> int | None:
    """The most host memory this process can use: the smaller of `physical_memory` and
    `cgroup_memory_limit` (a v1 group without a limit reports a number far past any
    machine's), ``None`` where neither is known."""
    known = [limit for limit in (physical_memory(), cgroup_memory_limit()) if limit is not None]
    return min(known, default=None)


def size_text(nbytes: int) -> str:
    """``nbytes`` for a message or log line: in GiB, MiB or KiB, one decimal."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def footprint(nbytes: int, pinned: bool) -> int:
    """The host memory a tensor of ``nbytes`` holds: torch's caching pinned allocator rounds
    a pinned allocation up to the next power of two."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes > 0 else nbytes


__all__ = ["cgroup_memory_limit", "footprint", "host_memory_limit", "physical_memory", "size_text"]
