"""Helpers for the multi-device tests: meshes over the devices at hand, and the
collectives of a compiled function read from its optimized HLO."""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import Mesh

# Mesh shapes for 8 devices (the virtual CPU devices of the test run). On a
# machine with fewer (two GPUs), the shapes that fit its device count.
MESH_AXES = {1: ("a",), 2: ("data", "model"), 3: ("data", "seq", "model")}


def mesh_shapes(n: int) -> list[tuple[int, ...]]:
    if n == 8:
        return [(8,), (2, 4), (2, 2, 2)]
    return list(dict.fromkeys([(n,), (1, n), (n, 1)]))


def needs_devices(n: int):
    """Skips a test on a machine with fewer than n devices (a single GPU); the
    CPU test run has 8."""
    import pytest

    return pytest.mark.skipif(len(jax.devices()) < n, reason=f"needs {n} devices")


def make_mesh(shape: tuple[int, ...]) -> Mesh:
    devices = np.array(jax.devices()[: math.prod(shape)]).reshape(shape)
    return Mesh(devices, MESH_AXES[len(shape)])


# A result shape is an array (f32[48,2]{1,0}) or, for combined collectives, a
# tuple of them.
_COLLECTIVE = re.compile(
    r"= (\([^)]*\)|\S+) "
    r"(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
)


def collectives(compiled_text: str) -> list[tuple[str, str]]:
    """(kind, result shape) of every collective in optimized HLO text, e.g.
    ("all-reduce", "f32[48,2]{1,0}")."""
    return [(m.group(2), m.group(1)) for m in _COLLECTIVE.finditer(compiled_text)]


def elements(hlo_shape: str) -> int:
    """How many elements an HLO shape holds: f32[48,2]{1,0} -> 96; a tuple
    shape counts all its arrays."""
    return sum(
        math.prod(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"\[([0-9,]*)\]", hlo_shape)
    )


def row_norm_collectives(
    centered: bool, local_rows: int, row_shards: int, hidden_shards: int,
    local_param_size: int, grad: bool,
) -> list[tuple[str, int]]:
    """The collectives a row norm's design calls for, as sorted (kind,
    elements): with the hidden dim split, the forward's statistics (RMSNorm: a
    psum of 1 float per row; LayerNorm: an all-gather of each slice's 2) and
    the backward's per-row dots (a psum of 1 or 2 floats per row); with the
    rows split, the backward's parameter gradients (one psum of all of them)."""
    found = []
    if hidden_shards > 1:
        found.append(("all-gather", hidden_shards * local_rows * 2) if centered
                     else ("all-reduce", local_rows))
        if grad:
            found.append(("all-reduce", local_rows * (2 if centered else 1)))
    if grad and row_shards > 1:
        found.append(("all-reduce", (2 if centered else 1) * local_param_size))
    return sorted(found)


def collective_sizes(compiled_text: str) -> list[tuple[str, int]]:
    """Sorted (kind, elements) of the collectives in optimized HLO text."""
    return sorted((kind, elements(shape)) for kind, shape in collectives(compiled_text))
