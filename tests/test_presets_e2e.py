"""Every shipped preset runs under its documented command, at the default worker count.

`pyflyte run workflows/train.py training_pipeline --cfg configs/<preset>.yaml`, as the README and
docs give it, with a second `--cfg` that only makes the run smaller (fewer epochs or rows) and
names its own registered model. The presets that other end-to-end tests already run as
documented are listed in ELSEWHERE, and a test holds that list and this one to every file in
configs/ (but the cluster's): a new preset without a run fails here.

The runs train on the 2 workers tests/conftest.py pins (the count `auto` times against one
process), so the run name says how each trained: the preset's model, its strategy and 2 workers.
The quick preset runs exactly as `make run ARGS="--cfg configs/quick.yaml"` does, workers left to
`auto`: it must say how many it chose, and print nothing that warns, its own advice included.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO, run_pipeline

# preset -> (the smaller run's second --cfg, the run name's start: model, strategy and workers)
SMALLER: dict[str, tuple[dict, str]] = {
    "quick": ({}, "mlp-ddp"),  # as `make run ARGS="--cfg configs/quick.yaml"` runs it: unchanged, on auto's choice
    "digits-mlp": ({"train": {"epochs": 1}}, "mlp-ddp2-"),
    "digits-cnn": ({"train": {"epochs": 1}, "augment": {"copies": 0}}, "cnn-ddp2-"),
    "digits-cnn-pipeline": ({"train": {"epochs": 1}, "augment": {"copies": 0}}, "cnn-pipeline2-"),
    "digits-mlp-pipeline": ({"train": {"epochs": 1}}, "mlp-pipeline2-"),
    "images-resnet": ({"data": {"options": {"rows": 600, "size": 16}}, "train": {"epochs": 1}}, "resnet-ddp2-"),
    "text-gpt": (
        {
            "tokenize": {"seq_len": 32},
            "model": {"options": {"layers": 1, "heads": 2, "width": 32}},
            "train": {"epochs": 1},
        },
        "gpt-ddp2-",
    ),
}
# Presets whose run, as `make run ARGS="--cfg configs/<preset>.yaml"` prints it, must hold nothing
# from a library that warns or draws a progress bar: `make run`'s smoke run.
QUIET = {"quick", "images-resnet"}  # `make run`, and the preset a photo folder starts from
# What a library prints when it warns, or draws a progress bar (flyscale's own advice, a `WARNING`
# from a `flyscale.*` logger or a `warning` line of the summary, is not matched).
THIRD_PARTY_NOISE = re.compile(
    r"^.*:\d+: \w*Warning: .*$"  # Python's warnings: UserWarning, FutureWarning, DeprecationWarning, ...
    r"|^[WE]\d{4} \d\d:\d\d:\d\d\.\d+ .*$"  # torch's C++-style log lines (W1205 11:54:38.922000 ...)
    r"|^.*\bWARNING\b(?! flyscale[.:]).*$"  # a library's logging at WARNING (MLflow, flytekit, torch)
    r"|^.*\d+%\|.*$",  # a tqdm progress bar (MLflow's "Downloading artifacts: 100%|...|")
    re.M,
)
# Presets whose documented command another end-to-end test runs, and where.
ELSEWHERE = {
    "diabetes-regression": "tests/test_regression.py",
    "images-cnn": "tests/test_examples.py",
    "text-gpt-bpe": "tests/test_language_model_e2e.py",
    "text-llama": "tests/test_huggingface_e2e.py",
    "search-digits": "tests/test_experiments_e2e.py",
    "scaling-digits": "tests/test_scaling_e2e.py",
    "scaling-text-gpt": "tests/test_scaling_e2e.py",
}


def test_every_shipped_preset_has_an_end_to_end_run():
    shipped = {p.stem for p in (REPO / "configs").glob("*.yaml")}
    assert shipped == set(SMALLER) | set(ELSEWHERE), "a preset without a run under its documented command"
    for preset, where in ELSEWHERE.items():
        assert f"configs/{preset}.yaml" in (REPO / where).read_text(), f"{where} does not run {preset}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("preset", sorted(SMALLER))
def test_the_preset_runs_as_documented(preset, tmp_path, mlflow_server):
    smaller, run_name = SMALLER[preset]
    name = f"preset-{preset}"
    args = [
        "--cfg",
        str(REPO / f"configs/{preset}.yaml"),
        "--cfg",
        json.dumps({**smaller, "mlflow": {"model_name": name}}),
    ]
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    if preset in QUIET:  # flytekit's own log as `make run` has it (shown with `pyflyte -v`), and auto's workers
        env.update(FLYTE_SDK_LOGGING_LEVEL="50", FLYSCALE_NPROC_PER_NODE="")
    proc = run_pipeline(tmp_path, *args, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    out = proc.stdout
    named = re.escape(run_name).replace("ddp2", "ddp[12]" if preset in QUIET else "ddp2")  # auto: 1 or 2 workers
    assert re.search(rf"^  run name    {named}", out, re.M), out[-2500:]
    assert re.search(r"^  gate        min_metric: (PASSED|FAILED) \(", out, re.M), out[-2500:]
    # int8 is registered as the twin only where it pays, and the summary says which, with the numbers.
    (int8,) = re.findall(r"^  int8        (pays: .*|not registered: it does not pay.*)$", out, re.M)
    if preset.startswith(("images", "digits-cnn")):  # a convolutional model: static QDQ tried where dynamic fails
        assert int8.startswith("pays: dynamic_int8") or "static_int8" in int8, int8
    ran = re.search(r"cache\s+ran (.*); from the cache", out)
    # Through to the end: registered where the gates passed, recorded with the run where one failed.
    assert ran and "train_model" in ran.group(1), out[-2500:]
    assert ("register_model" in ran.group(1)) == ("registered  preset-" in out), out[-2500:]
    assert ("record_candidate" in ran.group(1)) == ("registered  no version" in out), out[-2500:]
    if preset in QUIET:
        noise = THIRD_PARTY_NOISE.findall(proc.stdout + proc.stderr)
        assert noise == [], "third-party warnings or progress bars in the output:\n" + "\n".join(noise)
        # Nor a warning about its own defaults: auto timed the workers, and the summary says what it chose.
        assert not re.search(r"^  warning ", out, re.M) and "communication-bound" not in out + proc.stderr
        assert re.search(r"^  workers     (1 of 2|2) \(auto: in the preflight .* samples/s", out, re.M), out[-2500:]
