"""The machine's topology and memory, read from fake /sys and /proc trees, and the
placement and thread count the engine takes from them (cellbatch.machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cellbatch.machine import (
    CpuTopology,
    apply_placement,
    check_numa,
    parse_cpu_list,
    plan_placement,
    preset_thread_count,
    process_memory,
    read_memory,
    read_topology,
)
from cellbatch.types import InvalidArgumentError


def fake_sys(
    root: Path,
    nodes: dict[int, list[int]],
    siblings: int = 1,
    cgroup: dict[str, str] | None = None,
) -> Path:
    """A /sys tree: NUMA nodes -> their logical CPUs; every `siblings` consecutive CPUs of a
    node share one physical core (hyperthreads); cgroup files by name."""
    for node, cpus in nodes.items():
        folder = root / f"devices/system/node/node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(",".join(map(str, cpus)) + "\n")
        for index, cpu in enumerate(cpus):
            topology = root / f"devices/system/cpu/cpu{cpu}/topology"
            topology.mkdir(parents=True)
            (topology / "physical_package_id").write_text(f"{node}\n")
            (topology / "core_id").write_text(f"{index // siblings}\n")
    for name, text in (cgroup or {}).items():
        path = root / "fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def test_cpu_lists_parse_as_linux_writes_them() -> None:
    assert parse_cpu_list("0-3,8,10-11\n".strip()) == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("") == []


def test_hyperthreads_share_a_core_and_the_default_is_one_thread_per_core(tmp_path) -> None:
    root = fake_sys(tmp_path, {0: list(range(8))}, siblings=2)
    topology = read_topology(root, allowed=set(range(8)))
    assert len(topology.cores) == 4 and topology.cores[0].cpus == (0, 1)
    placement = plan_placement(topology, None)
    assert (placement.threads, placement.cpus, placement.node) == (4, None, None)
    assert "one per physical core" in placement.reason
    # An affinity mask of one sibling per core: still 4 cores.
    assert len(read_topology(root, allowed={0, 2, 4, 6}).cores) == 4


def test_two_nodes_bind_to_the_one_with_most_cores(tmp_path) -> None:
    root = fake_sys(tmp_path, {0: [0, 1, 2, 3], 1: [4, 5, 6, 7, 8, 9]})
    topology = read_topology(root, allowed=set(range(10)))
    assert sorted(topology.nodes) == [0, 1]
    placement = plan_placement(topology, None, "auto")
    assert placement.node == 1 and placement.cpus == (4, 5, 6, 7, 8, 9)
    assert placement.threads == 6 and "bound to NUMA node 1" in placement.reason
    # Equal nodes: the lowest-numbered. Only allowed CPUs count.
    assert plan_placement(read_topology(root, allowed={0, 1, 4, 5}), None).node == 0
    assert plan_placement(read_topology(root, allowed={0, 1, 2, 4}), None).node == 0


def test_more_threads_than_a_node_has_cores_spread_over_every_node(tmp_path) -> None:
    topology = read_topology(fake_sys(tmp_path, {0: [0, 1], 1: [2, 3]}), allowed={0, 1, 2, 3})
    spread = plan_placement(topology, 4, "auto")
    assert (spread.threads, spread.cpus, spread.node) == (4, None, None)
    assert "on 2 NUMA nodes" in spread.reason
    # Asked for a node, the threads stay on it whatever their count; off never binds.
    assert plan_placement(topology, 4, 1).cpus == (2, 3)
    assert plan_placement(topology, None, "off").cpus is None
    assert plan_placement(topology, None, "off").threads == 4


def test_a_bad_numa_choice_or_thread_count_is_refused_with_the_choices(tmp_path) -> None:
    topology = read_topology(fake_sys(tmp_path, {0: [0, 1], 2: [2, 3]}), allowed={0, 1, 2, 3})
    with pytest.raises(InvalidArgumentError, match=r"node 1 has none .* \[0, 2\]"):
        plan_placement(topology, None, 1)
    with pytest.raises(InvalidArgumentError, match=r"auto .* off .* node number"):
        check_numa("nearest")
    with pytest.raises(InvalidArgumentError, match="threads must be >= 1"):
        plan_placement(topology, 0)
    assert check_numa("2") == 2


def test_a_cgroup_quota_caps_the_default_threads(tmp_path) -> None:
    root = fake_sys(tmp_path, {0: list(range(8))}, cgroup={"cpu.max": "250000 100000"})
    topology = read_topology(root, allowed=set(range(8)))
    assert topology.cpu_quota == 2.5
    placement = plan_placement(topology, None)
    assert placement.threads == 3 and "quota of 2.5 CPUs" in placement.reason
    assert plan_placement(topology, 8).threads == 8  # asked: kept
    unlimited = fake_sys(tmp_path / "v1", {0: [0, 1]}, cgroup={"cpu/cpu.cfs_quota_us": "-1"})
    assert read_topology(unlimited, allowed={0, 1}).cpu_quota is None


def test_a_machine_without_topology_files_counts_each_cpu_as_a_core(tmp_path) -> None:
    topology = read_topology(tmp_path, allowed={0, 1, 2})
    assert len(topology.cores) == 3 and list(topology.nodes) == [0]
    assert plan_placement(topology, None).threads == 3


def test_a_thread_count_the_process_set_is_kept(monkeypatch) -> None:
    topology = CpuTopology((0, 1, 2, 3), read_topology(Path("/nonexistent"), {0, 1, 2, 3}).cores)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert preset_thread_count(4, 4) is None  # OpenMP's default: one per logical CPU
    assert preset_thread_count(4, 1) == 1
    placement = plan_placement(topology, None, "auto", preset_threads=1)
    assert placement.threads == 1 and "as the process set them" in placement.reason
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert preset_thread_count(4, 4) == 4


def test_this_machines_topology_reads_and_applies() -> None:
    """Whatever this machine is: every allowed CPU in exactly one core, and applying an
    unbound placement sets torch's threads and leaves the affinity alone."""
    topology = read_topology()
    assert sorted(cpu for core in topology.cores for cpu in core.cpus) == list(topology.cpus)
    before_threads, before_cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        apply_placement(plan_placement(topology, 1, "off"))
        assert torch.get_num_threads() == 1
        assert os.sched_getaffinity(0) == before_cpus
    finally:
        torch.set_num_threads(before_threads)


def test_memory_is_lowered_to_a_cgroups_limit_and_room(tmp_path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(
        "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:   12000000 kB\n"
    )
    plain = read_memory(proc, tmp_path / "no-sys")
    assert (plain.total_bytes, plain.available_bytes) == (16000000 * 1024, 12000000 * 1024)
    v2 = fake_sys(
        tmp_path / "v2", {}, cgroup={"memory.max": str(8 * 2**30), "memory.current": str(2**30)}
    )
    limited = read_memory(proc, v2)
    assert (limited.total_bytes, limited.available_bytes) == (8 * 2**30, 7 * 2**30)
    v1 = fake_sys(
        tmp_path / "v1",
        {},
        cgroup={"memory/memory.limit_in_bytes": str(2**62), "memory/memory.usage_in_bytes": "5"},
    )
    assert read_memory(proc, v1) == plain  # "no limit" is a huge number
    here = read_memory()
    assert 0 < here.available_bytes <= here.total_bytes


def test_the_process_s_resident_and_peak_bytes(tmp_path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "status").write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t1024 kB\n")
    assert process_memory("VmHWM", tmp_path) == 2048 * 1024
    assert process_memory("VmRSS", tmp_path) == 1024 * 1024
    assert process_memory("VmSwap", tmp_path) == 0 == process_memory("VmRSS", tmp_path / "none")
    assert 0 < process_memory("VmRSS") <= process_memory("VmHWM")
