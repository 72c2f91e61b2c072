"""A pytest plugin for the test suite under compute-sanitizer (gpu_run.sh's sanitize step).

    pytest -p sanitize_plugin --shard 3/40 --ids-from ids.txt --clear-caches tests/...

(with this folder on PYTHONPATH). Under memcheck the row-norm tests take about a
second each, too long for one process under a run's time limit, and a process's
GPU memory grew with the tests it had run until the GPU was full
(benchmarks/NOTES.md, v59). So the suite is split into shards, each a process of
its own and few tests long; the tests a run left unchecked can be run again from
a file of their ids; and the GPU memory a process holds is written after each
test, to find what grows.
"""

from __future__ import annotations

import gc
import os

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("sanitize_plugin")
    group.addoption("--shard", metavar="I/N", help="only every N-th collected test, from the I-th")
    group.addoption(
        "--ids-from",
        metavar="FILE",
        help="only the tests FILE names, one 'test_file.py::test_name[params]' a line "
        "(ids with spaces, which a shell would split)",
    )
    group.addoption(
        "--clear-caches",
        action="store_true",
        help="after each test, drop JAX's compiled executables and collect garbage",
    )


def _keep(config, items, kept):
    kept_ids = {id(item) for item in kept}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
    items[:] = kept


def pytest_collection_modifyitems(config, items):
    ids_from = config.getoption("--ids-from")
    if ids_from:
        with open(ids_from) as f:
            wanted = {line.strip() for line in f if line.strip()}
        _keep(config, items, [t for t in items if f"{t.path.name}::{t.name}" in wanted])
    shard = config.getoption("--shard")
    if shard:
        index, count = (int(part) for part in shard.split("/"))
        if not 0 <= index < count:
            raise pytest.UsageError(f"--shard {shard}: expected I/N with 0 <= I < N")
        _keep(config, items, items[index::count])


def _gpu_memory_mib() -> str | None:
    """GPU memory this process holds and the device's total in use (None without NVML)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        mine = [
            p.usedGpuMemory
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if p.pid == os.getpid() and p.usedGpuMemory is not None
        ]
        used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    except pynvml.NVMLError:
        return None
    process = f"{mine[0] / 2**20:.0f}" if mine else "?"  # (another PID namespace)
    return f"process {process} MiB, device {used / 2**20:.0f} MiB"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if item.config.getoption("--clear-caches"):
        import jax

        jax.clear_caches()
        gc.collect()


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.when != "teardown":
        return
    # One line a test, NVML or not: sanitize_coverage.py counts the tests by it.
    memory = _gpu_memory_mib() or "(no NVML)"
    terminal = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
    if terminal is not None:
        terminal.write_line(f"gpu memory after {report.nodeid.split('/')[-1]}: {memory}")


_config = None


def pytest_configure(config):
    global _config
    _config = config
