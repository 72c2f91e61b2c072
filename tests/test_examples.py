"""The examples run and do what they say (a short run of each)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name, *args):
    """The example's stdout, run on CPU; its losses must fall."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *args],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout, [float(v) for v in re.findall(r"loss (\S+)", out.stdout)]


def test_sharded_training_loss_falls():
    stdout, losses = run_example("sharded_training.py", "--steps", "20")
    assert "mesh {'data': 4, 'model': 2}" in stdout, stdout
    assert len(losses) >= 2 and losses[-1] < 0.5 * losses[0], stdout


def test_llama_trains_and_decodes():
    stdout, losses = run_example("llama_train.py", "--steps", "40")
    assert len(losses) >= 2 and losses[-1] < 0.2 * losses[0], stdout
    assert "(100% of steps follow the rule)" in stdout, stdout


def test_unet_and_data_parallel_resnet_train():
    stdout, losses = run_example("unet_train.py", "--steps", "10", "--batch", "2", "--size",
                                 "16", "--channels", "32")
    unet = [float(v) for v in re.findall(r"unet \[jaxnorm\] step +\d+ +loss (\S+)", stdout)]
    resnet = [float(v) for v in re.findall(r"resnet \[jaxnorm\] step +\d+ +loss (\S+)", stdout)]
    assert unet[-1] < 0.7 * unet[0] and resnet[-1] < 0.7 * resnet[0], stdout
    gap = re.search(r"over 8 devices .* differ from one device's by at most (\S+);", stdout)
    assert gap and float(gap.group(1)) < 1e-4, stdout

