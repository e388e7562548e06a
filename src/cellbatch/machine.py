"""The machine the engine runs on: its CPU topology and memory, read from Linux's /sys and
/proc, and where the engine's threads go.

Owns: `CpuTopology` (`read_topology`: the logical CPUs this process may use, the physical
cores and NUMA nodes they belong to, a cgroup's CPU quota), `MemoryInfo` (`read_memory`:
total and available memory, a cgroup's limit counted; `process_memory`: this process's
resident and peak bytes), `Placement` (`plan_placement`: how
many threads, and which CPUs when the machine has several NUMA nodes) and
`apply_placement`; `FileMappings` (this process's file-backed memory: which bytes of
tensors it holds, and handing read pages of a mapped file back).
Promises: every reader takes the root it reads from, so tests can hand it a fake tree;
a file that is missing or unreadable (another OS, a container without sysfs) falls back
to the plain answer (each logical CPU its own core, one node, no limit), never an error.
The default thread count is one per physical core (hyperthreads share a core's vector
units, which the products saturate), capped by a cgroup's CPU quota; a count the process
already set (torch.set_num_threads, OMP_NUM_THREADS) is kept. With NUMA nodes among the
allowed CPUs, "auto" runs on the node with the most cores (its memory then holds the
weights and the KV pool, which the engine's threads touch first), as vLLM's CPU backend
binds each engine to one node; asked for more threads than that node has, it runs on
them all.
Never: changes anything but the calling thread's CPU affinity and torch's thread count
(threads created afterwards, the engine's among them, inherit both).
"""

from __future__ import annotations

import bisect
import ctypes
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from cellbatch.types import InvalidArgumentError

NUMA_CHOICES = ("auto", "off")  # or a node number
_UNLIMITED = 1 << 60  # cgroup "no limit" values are near 2^63


@dataclass(frozen=True)
class Core:
    """One physical core: the allowed logical CPUs on it (hyperthreads) and its node."""

    cpus: tuple[int, ...]
    node: int


@dataclass(frozen=True)
class CpuTopology:
    """The CPUs this process may run on, grouped into physical cores."""

    cpus: tuple[int, ...]
    cores: tuple[Core, ...]
    cpu_quota: float | None = None  # a cgroup's limit, in CPUs (None: no limit)

    @property
    def nodes(self) -> dict[int, tuple[Core, ...]]:
        """NUMA node -> its cores among the allowed CPUs."""
        nodes: dict[int, list[Core]] = {}
        for core in self.cores:
            nodes.setdefault(core.node, []).append(core)
        return {node: tuple(cores) for node, cores in sorted(nodes.items())}


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def parse_cpu_list(text: str) -> list[int]:
    """Linux's CPU list format ("0-3,8,10-11") -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.split(","):
        if not part.strip():
            continue
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


def read_topology(sys_root: Path = Path("/sys"), allowed: set[int] | None = None) -> CpuTopology:
    """The topology of `allowed` (default: this process's CPU affinity), from sys_root."""
    if allowed is None:
        allowed = set(os.sched_getaffinity(0))
    cpu_root = sys_root / "devices/system/cpu"
    node_of: dict[int, int] = {}
    for node_dir in sorted((sys_root / "devices/system/node").glob("node[0-9]*")):
        listed = _read(node_dir / "cpulist")
        if listed is not None:
            for cpu in parse_cpu_list(listed):
                node_of[cpu] = int(node_dir.name.removeprefix("node"))
    by_core: dict[tuple[int, int, int], list[int]] = {}
    for cpu in sorted(allowed):
        topology = cpu_root / f"cpu{cpu}/topology"
        package, core = _read(topology / "physical_package_id"), _read(topology / "core_id")
        node = node_of.get(cpu, 0)
        # Unknown ids: the CPU is a core of its own.
        key = (node, int(package), int(core)) if package and core else (node, -1, cpu)
        by_core.setdefault(key, []).append(cpu)
    cores = tuple(Core(tuple(cpus), key[0]) for key, cpus in sorted(by_core.items()))
    return CpuTopology(tuple(sorted(allowed)), cores, _cpu_quota(sys_root / "fs/cgroup"))


def _cpu_quota(cgroup: Path) -> float | None:
    """CPUs a cgroup allows (v2 cpu.max "quota period", v1 cfs files); None: no limit."""
    text = _read(cgroup / "cpu.max")
    if text is not None:
        quota, _, period = text.partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    quota_text, period_text = (
        _read(cgroup / "cpu" / name) for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")
    )
    if quota_text is None or period_text is None or int(quota_text) <= 0:
        return None
    return int(quota_text) / int(period_text)


@dataclass(frozen=True)
class MemoryInfo:
    """Bytes of memory: the machine's (or its cgroup's, when lower) total, and how much
    can still be allocated without swapping."""

    total_bytes: int
    available_bytes: int


def process_memory(field: str, proc_root: Path = Path("/proc")) -> int:
    """Bytes of this process's /proc/self/status `field` ("VmRSS": resident now, "VmHWM":
    its peak); 0 where it cannot be read."""
    for line in (_read(proc_root / "self" / "status") or "").splitlines():
        name, _, value = line.partition(":")
        if name == field and value.split():
            return int(value.split()[0]) * 1024
    return 0


def read_memory(proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys")) -> MemoryInfo:
    """/proc/meminfo's MemTotal and MemAvailable, lowered to a cgroup's limit and the room
    left under it (v2 memory.max - memory.current, v1 memory.limit_in_bytes - usage)."""
    fields: dict[str, int] = {}
    for line in (_read(proc_root / "meminfo") or "").splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    total = fields.get("MemTotal", 0)
    available = fields.get("MemAvailable", fields.get("MemFree", total))
    cgroup = sys_root / "fs/cgroup"
    for limit_file, usage_file in (
        (cgroup / "memory.max", cgroup / "memory.current"),
        (cgroup / "memory/memory.limit_in_bytes", cgroup / "memory/memory.usage_in_bytes"),
    ):
        limit, usage = _read(limit_file), _read(usage_file)
        if limit is None or not limit.isdigit() or int(limit) >= _UNLIMITED:
            continue
        room = max(0, int(limit) - int(usage)) if usage and usage.isdigit() else int(limit)
        total = min(total, int(limit)) if total else int(limit)
        available = min(available, room)
    return MemoryInfo(total, available)


@dataclass(frozen=True)
class Placement:
    """Where the engine's threads run: `threads` of them, on `cpus` (None: wherever the
    process may run), `node` the NUMA node they are bound to (None: not bound), and why,
    in words."""

    threads: int
    cpus: tuple[int, ...] | None
    node: int | None
    reason: str


def check_numa(choice: str | int) -> str | int:
    """The checked `numa` choice: "auto", "off" or a node number."""
    if isinstance(choice, int) and not isinstance(choice, bool) and choice >= 0:
        return choice
    if isinstance(choice, str) and choice.isdigit():
        return int(choice)
    if choice in NUMA_CHOICES:
        return choice
    raise InvalidArgumentError(
        f"unknown numa choice {choice!r}; use auto (bind to one node where there are "
        "several), off (run on every allowed CPU) or a node number"
    )


def _cores_within_quota(cores: int, quota: float | None) -> int:
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def plan_placement(
    topology: CpuTopology,
    threads: int | None,
    numa: str | int = "auto",
    preset_threads: int | None = None,
) -> Placement:
    """The placement for `threads` asked (None: the default) under `numa`;
    `preset_threads` is a count the process already set (kept when none is asked)."""
    numa = check_numa(numa)
    if threads is not None and threads < 1:
        raise InvalidArgumentError(f"threads must be >= 1, got {threads}")
    nodes = topology.nodes
    if isinstance(numa, int) and numa not in nodes:
        raise InvalidArgumentError(
            f"NUMA node {numa} has none of this process's CPUs; use one of {sorted(nodes)}, "
            "auto or off"
        )
    node: int | None = None
    if isinstance(numa, int):
        node = numa
    elif numa == "auto" and len(nodes) > 1:
        node = max(nodes, key=lambda n: (len(nodes[n]), -n))  # most cores, lowest number
    cores = nodes[node] if node is not None else topology.cores
    default = _cores_within_quota(len(cores), topology.cpu_quota)
    count = threads or preset_threads or default
    if threads:
        why = "as asked"
    elif preset_threads:
        why = "as the process set them"
    else:
        why = "one per physical core"
        if default < len(cores):
            why += f", within the cgroup's quota of {topology.cpu_quota:g} CPUs"
    threads_word = f"{count} thread{'' if count == 1 else 's'}"
    if node is not None and numa == "auto" and count > len(cores):
        node = None  # more threads than the best node has cores: spread over every node
    if node is None:
        spread = f" on {len(nodes)} NUMA nodes" if len(nodes) > 1 else ""
        reason = f"{threads_word} ({why}) on {len(topology.cores)} cores{spread}"
        return Placement(count, None, None, reason)
    cpus = tuple(cpu for core in cores for cpu in core.cpus)
    reason = (
        f"{threads_word} ({why}) bound to NUMA node {node}, {len(cores)} of "
        f"{len(topology.cores)} cores (its memory holds the weights and the KV pool)"
    )
    return Placement(count, cpus, node, reason)


def preset_thread_count(logical_cpus: int, current: int) -> int | None:
    """The thread count the process already set, or None where torch's count is still its
    default (OpenMP's: one per allowed logical CPU) and OMP_NUM_THREADS is unset."""
    if os.environ.get("OMP_NUM_THREADS"):
        return current
    return None if current == logical_cpus else current


def apply_placement(placement: Placement) -> None:
    """Sets torch's thread count and, when bound, this thread's CPUs (threads started
    from it afterwards inherit them)."""
    torch.set_num_threads(placement.threads)
    if placement.cpus is not None:
        os.sched_setaffinity(0, placement.cpus)


class FileMappings:
    """The file-backed mappings of this process (/proc/self/maps), as read when made."""

    def __init__(self, maps: Path = Path("/proc/self/maps")) -> None:
        ranges = []
        for line in (_read(maps) or "").splitlines():
            fields = line.split(maxsplit=5)
            # A path, not a pseudo-file ("[heap]") nor an anonymous mapping.
            if len(fields) == 6 and fields[5].startswith("/"):
                low, _, high = fields[0].partition("-")
                ranges.append((int(low, 16), int(high, 16)))
        ranges.sort()
        self._starts = [low for low, _ in ranges]
        self._ranges = ranges

    def _mapping(self, address: int, length: int) -> bool:
        index = bisect.bisect_right(self._starts, address) - 1
        return index >= 0 and address + length <= self._ranges[index][1]

    def bytes_of(self, tensors: list[torch.Tensor]) -> int:
        """Bytes of `tensors` (each storage once) that lie in a file mapping."""
        seen: set[int] = set()
        total = 0
        for tensor in tensors:
            if tensor.layout != torch.strided or tensor.is_mkldnn:
                continue  # an opaque (oneDNN) tensor: the library's own memory
            storage = tensor.untyped_storage()
            address, size = storage.data_ptr(), storage.nbytes()
            if address not in seen and size and self._mapping(address, size):
                seen.add(address)
                total += size
        return total

    def release(self, address: int, length: int) -> None:
        """Hands back the pages of a mapped file's bytes [address, address + length) that
        have been read (they leave the process's resident set; reading them again reads
        the file): for bytes converted into another tensor. Bytes outside a file mapping
        are left alone: freed heap memory may already hold something else."""
        page = mmap.PAGESIZE
        start = -(-address // page) * page  # the whole pages inside the range only
        end = (address + length) // page * page
        if end <= start or not self._mapping(address, length):
            return
        # Dropped from a read-only mapping, the pages are read from the file if touched.
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
