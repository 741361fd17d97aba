"""The trainer's command line as a newcomer meets it (issue 54): scripts/run.sh refuses --device cuda
without a GPU before phase 1, and a run of the small model on a CPU says up front that it is slow."""

import argparse
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TRAIN_ARGS = os.path.join(ROOT, "python", "flowmoe", "train_args.py")
NO_GPU = "--no-cuda=no GPU is visible on this machine"


def train_args(*argv):
    return subprocess.run([sys.executable, TRAIN_ARGS, *argv], capture_output=True, text=True, timeout=60)


def test_device_cuda_is_refused_where_no_gpu_is_visible():
    r = train_args(NO_GPU, "--device", "cuda")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("flowmoe.train: error: --device cuda: no GPU is visible on this machine; expected "
                                "--device cpu (or no --device: the CPU is the default here)")
    ok = train_args(NO_GPU, "--device", "cpu")
    assert ok.returncode == 0 and "device=cpu" in ok.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU may be visible here")
def test_run_sh_refuses_device_cuda_before_phase_1():
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "run.sh"), "--device", "cuda"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "== 1/6" not in r.stdout and "no GPU is visible" in r.stderr


def test_small_help_mentions_the_cpu():
    r = train_args("--help")
    assert r.returncode == 0 and "on a CPU about 3 minutes per step" in " ".join(r.stdout.split())


def test_small_model_on_a_cpu_gets_a_slow_warning():
    from flowmoe.train import slow_on_cpu_note

    args = argparse.Namespace(config_name="small", steps=1)
    note = slow_on_cpu_note(args, torch.device("cpu"), 4096)
    assert "slow" in note and "3m15s per step" in note and "--tiny" in note
    assert slow_on_cpu_note(argparse.Namespace(config_name="tiny", steps=30), torch.device("cpu"), 512) is None
    assert slow_on_cpu_note(args, torch.device("meta"), 4096) is None  # (any non-CPU device: no note)
