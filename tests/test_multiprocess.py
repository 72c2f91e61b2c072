"""Two processes on localhost, joined with jax.distributed as on a multi-host
cluster, each with 4 CPU devices: a sharded forward and backward agrees with
the single-process result (checked in each process by multiprocess_worker.py)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_agree_with_one():
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), address, str(i), "2"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out}"
        assert out.count("ok, loss") == 2, out
        print(out)
