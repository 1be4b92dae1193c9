"""The GPU check (benchmarks/gpu_check.py) without a GPU: it skips cleanly, and its
`--device cpu --backend gloo` mode runs the same path (a real process group, the ddp strategy
under DDP, autocast) so that its logic and its checks are exercised here."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from flyscale.train import distributed
from flyscale.train.telemetry import EpochMetrics

REPO = Path(__file__).resolve().parents[1]
# Small enough for CPUs, where bf16 is slow (the CNN at about 100 samples/s), big enough to learn.
CPU_RUN = ["--device", "cpu", "--backend", "gloo", "--epochs", "2", "--max-train-rows", "384", "--min-accuracy", "0.75"]
DDP = ["--strategies", "ddp"]

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU here: the check would run, not skip")


def run_check(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    # One thread: on a shared 2-core machine two threads wait on each other's core (2-3x slower).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@no_cuda
@pytest.mark.slow
def test_without_a_gpu_it_says_it_skipped_and_exits_0(tmp_path):
    out = tmp_path / "skip.json"
    proc = run_check("--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: skipped: no CUDA device"), proc.stdout
    assert json.loads(out.read_text())["status"] == "skipped"


@no_cuda
def test_require_cuda_turns_the_skip_into_a_failure(capsys):
    assert gpu_check.main(["--require-cuda"]) == 1
    assert "failing, as --require-cuda asks" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cpu", "--backend", "nccl"], "--backend nccl needs --device cuda"),
        (["--precisions", "fp32,fp8"], "--precisions: fp32,fp8 is not a subset"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "summary.json"
    proc = run_check(*CPU_RUN, *DDP, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_fsdp_shards_the_mlp_over_the_one_rank_group_in_fp32_and_bf16(tmp_path):
    """fsdp's bf16 is FSDP2's mixed-precision policy: parameters gathered and computed in bf16."""
    out = tmp_path / "fsdp.json"
    proc = run_check(*CPU_RUN, "--models", "mlp", "--strategies", "fsdp", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {r["precision"]: r for r in json.loads(out.read_text())["runs"]}
    assert {p: r["status"] for p, r in runs.items()} == {"fp32": "ok", "fp16": "unsupported", "bf16": "ok"}
    assert runs["bf16"]["compute_dtype"] == ["bfloat16"] and runs["fp32"]["compute_dtype"] == ["float32"]
    assert all(r["strategy"] == "fsdp" for r in runs.values()) and "mlp  fsdp  bf16 " in proc.stdout
    assert "FSDP2's policy" in runs["fp16"]["reason"]


@pytest.mark.slow
def test_cpu_gloo_run_trains_both_models_in_fp32_and_bf16(cpu_run):
    proc, summary = cpu_run
    assert summary["status"] == "ok" and summary["environment"]["backend"] == "gloo"
    ran = {(r["model"], r["precision"]): r for r in summary["runs"] if r["status"] == "ok"}
    assert set(ran) == {("mlp", "fp32"), ("mlp", "bf16"), ("cnn", "fp32"), ("cnn", "bf16")}
    for (model, precision), r in ran.items():
        assert r["compute_dtype"] == [{"fp32": "float32", "bf16": "bfloat16"}[precision]], r
        assert r["samples_per_s"] > 0 and r["grad_comm_fraction"] > 0, r  # trained under DDP, all-reduces timed
        assert math.isfinite(r["train_loss"]) and r["val_accuracy"] >= 0.75, r
        assert f"{model:<4} ddp   {precision:<5}" in proc.stdout and "samples/s" in proc.stdout


@pytest.mark.slow
def test_fp16_on_cpu_is_reported_as_cuda_only_not_faked(cpu_run):
    proc, summary = cpu_run
    fp16 = [r for r in summary["runs"] if r["precision"] == "fp16"]
    assert [r["model"] for r in fp16] == ["mlp", "cnn"]
    for r in fp16:
        assert r["status"] == "unsupported" and "samples_per_s" not in r
        assert "CUDA-only" in r["reason"] and "needs CUDA" in r["reason"]  # flyscale's own refusal, quoted
    assert "ddp   fp16  not run: fp16 with GradScaler is CUDA-only" in proc.stdout


def test_a_run_below_the_accuracy_bar_fails_with_a_clear_message(tmp_path, capsys):
    """In this process (a subprocess would cost seconds of imports): a real gloo group, one short run."""
    loggers = [logging.getLogger(n) for n in ("flyscale", *distributed.plugin_packages())]
    levels = [lg.level for lg in loggers]  # the check sets flyscale's loggers as the training task does
    out = tmp_path / "fail.json"
    try:
        rc = gpu_check.main(
            [
                "--device",
                "cpu",
                "--models",
                "mlp",
                "--strategies",
                "ddp",
                "--precisions",
                "fp32",
                "--epochs",
                "1",
                "--max-train-rows",
                "64",
                "--min-accuracy",
                "0.99",
                "--out",
                str(out),
            ]
        )
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    assert rc == 1 and not torch.distributed.is_initialized()
    assert "gpu_check: FAILED: 1 of 1 runs: mlp ddp fp32: validation accuracy" in capsys.readouterr().err
    assert json.loads(out.read_text())["status"] == "failed"


def _epoch(loss: float = 0.1, accuracy: float = 0.95) -> EpochMetrics:
    return EpochMetrics(
        epoch=0,
        train_loss=loss,
        train_accuracy=None,
        val_loss=loss,
        val_accuracy=accuracy,
        seconds=1.0,
        samples_per_s=100.0,
    )


@pytest.mark.parametrize(
    "epochs, row, problem",
    [
        ([_epoch(math.nan)], {}, "loss not finite in epoch(s) [1]"),
        ([_epoch(accuracy=0.5)], {"val_accuracy": 0.5}, "validation accuracy 0.5000 < 0.9"),
        ([_epoch()], {"compute_dtype": ["float32"]}, "layers computed in ['float32'], expected bfloat16"),
        ([_epoch()], {"grad_comm_fraction": 0.0}, "no gradient all-reduce ran"),
    ],
)
def test_each_check_catches_what_it_is_for(epochs, row, problem):
    good = {"val_accuracy": 0.95, "compute_dtype": ["bfloat16"], "grad_comm_fraction": 0.05}
    assert gpu_check.check(good, [_epoch()], "bf16", 0.9) == []
    problems = gpu_check.check({**good, **row}, epochs, "bf16", 0.9)
    assert len(problems) == 1 and problem in problems[0], problems
