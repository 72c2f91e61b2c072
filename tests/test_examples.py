"""The examples run and do what they say (a short run of each)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_sharded_training_loss_falls():
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "sharded_training.py"), "--steps", "20"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mesh {'data': 4, 'model': 2}" in out.stdout, out.stdout
    losses = [float(v) for v in re.findall(r"loss (\S+)", out.stdout)]
    assert len(losses) >= 2 and losses[-1] < 0.5 * losses[0], out.stdout


def test_llama_trains_and_decodes():
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "llama_train.py"), "--steps", "40"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    losses = [float(v) for v in re.findall(r"loss (\S+)", out.stdout)]
    assert len(losses) >= 2 and losses[-1] < 0.2 * losses[0], out.stdout
    assert "(100% of steps follow the rule)" in out.stdout, out.stdout
