"""The whole pipeline on Parquet shards in an S3 bucket (a real moto server), under real `pyflyte run`.

A bad row in one shard is quarantined with its reason; the rest trains the CNN to the same bar
as the built-in digits dataset. The same shards streamed (`parquet_stream`) are prepared chunk by
chunk as typed examples (a field per column) and are held to the same rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import boto3
import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient

from flyscale_plugins.datasets import DIGITS_PIXELS, digits
from tests.conftest import run_pipeline


def _aws(endpoint: str) -> dict:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def _upload(tmp_path, endpoint: str, frame: pd.DataFrame, prefix: str) -> None:
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    if "features" not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket="features")
    for i, start in enumerate(range(0, len(frame), 600)):
        path = tmp_path / f"part-{i}.parquet"
        frame.iloc[start : start + 600].to_parquet(path, index=False)
        s3.upload_file(str(path), "features", f"{prefix}/{path.name}")


@pytest.mark.timeout(900)
def test_pipeline_trains_from_s3_parquet_shards(tmp_path, moto_endpoint, mlflow_server):
    aws = _aws(moto_endpoint)
    frame = digits.load(None).rename(columns={"label": "digit"})
    frame.loc[7, "pixel_12"] = 99.0  # out of the declared range: must be quarantined, not trained on
    _upload(tmp_path, moto_endpoint, frame, "digits/v1")

    cfg = tmp_path / "s3.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "data": {
                    "dataset": "parquet",
                    "options": {
                        "path": "s3://features/digits/v1",
                        "label": "digit",
                        "features": DIGITS_PIXELS,
                        "num_classes": 10,
                        "input_shape": [1, 8, 8],
                        "ranges": {c: [0, 16] for c in DIGITS_PIXELS},
                    },
                },
                "augment": {"names": ["shift", "noise"], "copies": 1},
                "model": {"name": "cnn", "options": {"channels": [8, 16], "hidden": 64}},
                "train": {"epochs": 10, "batch_size": 64},
                "mlflow": {"experiment": "s3", "model_name": "s3-digits"},
            }
        )
    )
    uri = mlflow_server
    proc = run_pipeline(tmp_path, "--cfg", str(cfg), env={**aws, "MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "1797 rows: 1796 valid, 1 quarantined" in proc.stdout
    run_id = re.search(r"mlflow\s+run (\w+)", proc.stdout).group(1)
    assert f"quarantine  the rows and their reasons: artifacts data/quarantine/ of mlflow run {run_id}" in proc.stdout
    run = MlflowClient(uri).get_run(run_id)
    assert run.data.tags["flyscale.dataset"] == "parquet:s3://features/digits/v1"
    assert run.data.metrics["validation_quarantined_rows"] == 1
    assert run.data.metrics["test_accuracy"] >= 0.95
    # The rejected row travels with the run: its values, its file and row there, and the reason.
    path = MlflowClient(uri).download_artifacts(run_id, "data/quarantine", str(tmp_path))
    (row,) = pd.read_parquet(path).itertuples()
    assert (row.source_file, row.source_row) == ("s3://features/digits/v1/part-0.parquet", 7)
    assert "pixel_12: in_range" in row.reason and "99" in row.reason and row.pixel_12 == 99.0
    report = MlflowClient(uri).download_artifacts(run_id, "data/validation/validation.html", str(tmp_path))
    assert "Quarantined rows per check" in open(report).read()


@pytest.mark.timeout(900)
def test_streamed_s3_shards_are_prepared_as_examples_and_lose_no_row(tmp_path, moto_endpoint, mlflow_server):
    frame = digits.load(None).rename(columns={"label": "digit"})
    frame.loc[7, "pixel_12"] = 99.0  # out of range, in the first shard
    frame.iloc[1500] = frame.iloc[20]  # a duplicate of a row two shards (and chunks) earlier
    _upload(tmp_path, moto_endpoint, frame, "digits/stream")
    cfg = tmp_path / "stream.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "data": {
                    "dataset": "parquet_stream",
                    "options": {
                        "path": "s3://features/digits/stream",
                        "label": "digit",
                        "num_classes": 10,
                        "input_shape": [1, 8, 8],
                        "ranges": {c: [0, 16] for c in DIGITS_PIXELS},
                    },
                },
                "train": {"epochs": 6, "batch_size": 64, "num_workers": 2},
                "mlflow": {"experiment": "stream", "model_name": "stream-digits"},
            }
        )
    )
    uri = mlflow_server
    proc = run_pipeline(tmp_path, "--cfg", str(cfg), env={**_aws(moto_endpoint), "MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "1797 rows: 1795 valid, 2 quarantined" in proc.stdout
    assert "combine_shards" in proc.stdout and "load_data" not in proc.stdout  # the examples' branch ran
    # ...and training streamed its splits (parquet_stream sets data.streaming), never reading them whole.
    assert "training streams its" in proc.stdout + proc.stderr and "into memory" not in proc.stdout + proc.stderr
    run_id = re.search(r"mlflow\s+run (\w+)", proc.stdout).group(1)
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.data.metrics["validation_quarantined_rows"] == 2
    assert run.data.metrics["test_accuracy"] >= 0.9
    quarantined = client.download_artifacts(run_id, "data/quarantine", str(tmp_path))
    quarantine = pd.read_parquet(quarantined).sort_values(["source_file", "source_row"])
    assert quarantine["source_file"].tolist() == [
        "s3://features/digits/stream/part-0.parquet",
        "s3://features/digits/stream/part-2.parquet",
    ]
    assert quarantine["source_row"].tolist() == [7, 300]
    assert quarantine["reason"].tolist()[0] == "pixel_12: in_range(0.0, 16.0) (got 99.0)"
    # The duplicate names the row it repeats: row 20 of the first shard.
    twin = "s3://features/digits/stream/part-0.parquet row 20"
    assert quarantine["reason"].iloc[1] == f"duplicate: the same values as an earlier row ({twin})"


@pytest.mark.timeout(600)
def test_data_rejected_for_too_many_bad_rows_keeps_every_row_and_the_config_in_mlflow(tmp_path, mlflow_server):
    """Over the quarantine ceiling the run fails, and loses nothing: its MLflow run holds the
    quarantined rows with their reasons, its params and its config.yaml, and the error says where."""
    frame = digits.load(None)
    frame.loc[:199, "pixel_12"] = 99.0  # 200 of 1797 rows (11%) out of range: over the 5% ceiling
    (tmp_path / "rows").mkdir()
    frame.to_parquet(tmp_path / "rows" / "part-0.parquet", index=False)
    preset = {
        "data": {
            "dataset": "parquet",
            "options": {"path": str(tmp_path / "rows"), "ranges": {c: [0, 16] for c in DIGITS_PIXELS}},
        },
        "mlflow": {"experiment": "rejected-data", "model_name": "rejected"},
    }
    proc = run_pipeline(tmp_path, "--cfg", json.dumps(preset), env={"MLFLOW_TRACKING_URI": mlflow_server})
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "200 of 1797 rows failed validation" in log, log[-3000:]
    kept = re.search(r"kept: artifacts data/quarantine/ of MLflow run (\w+)", log)
    assert kept, log[-3000:]
    client = MlflowClient(mlflow_server)
    run = client.get_run(kept.group(1))
    assert run.info.status == "FAILED" and "failed validation" in run.data.tags["flyscale.failure"]
    assert run.data.params["data.dataset"] == "parquet" and run.data.params["train.epochs"] == "30"
    assert run.data.metrics["validation_quarantined_rows"] == 200
    config = yaml.safe_load(Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text())
    assert config["data"]["options"]["path"] == str(tmp_path / "rows")
    rows = pd.read_parquet(client.download_artifacts(run.info.run_id, "data/quarantine", str(tmp_path)))
    assert len(rows) == 200 and rows["reason"].str.contains("pixel_12: in_range").all()
    assert set(rows["source_file"]) == {str(tmp_path / "rows" / "part-0.parquet")}
