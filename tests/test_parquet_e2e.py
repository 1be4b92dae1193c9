"""The whole pipeline on Parquet shards in an S3 bucket (a real moto server), under real `pyflyte run`.

A bad row in one shard is quarantined with its reason; the rest trains the CNN to the same bar
as the built-in digits dataset.
"""

from __future__ import annotations

import re

import boto3
import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient

from flyscale_plugins.datasets import DIGITS_PIXELS, digits
from tests.conftest import run_pipeline


@pytest.mark.timeout(900)
def test_pipeline_trains_from_s3_parquet_shards(tmp_path, moto_endpoint):
    aws = {
        "AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    s3.create_bucket(Bucket="features")
    frame = digits.load(None).rename(columns={"label": "digit"})
    frame.loc[7, "pixel_12"] = 99.0  # out of the declared range: must be quarantined, not trained on
    for i, start in enumerate(range(0, len(frame), 600)):
        path = tmp_path / f"part-{i}.parquet"
        frame.iloc[start : start + 600].to_parquet(path, index=False)
        s3.upload_file(str(path), "features", f"digits/v1/{path.name}")

    cfg = tmp_path / "s3.yaml"
    cfg.write_text(yaml.safe_dump({
        "data": {"dataset": "parquet", "options": {
            "path": "s3://features/digits/v1", "label": "digit", "features": DIGITS_PIXELS, "num_classes": 10,
            "input_shape": [1, 8, 8], "ranges": {c: [0, 16] for c in DIGITS_PIXELS},
        }},
        "augment": {"names": ["shift", "noise"], "copies": 1},
        "model": {"name": "cnn", "options": {"channels": [8, 16], "hidden": 64}},
        "train": {"epochs": 10, "batch_size": 64},
        "mlflow": {"experiment": "s3", "model_name": "s3-digits"},
    }))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_pipeline(tmp_path, "--cfg", str(cfg), env={**aws, "MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "1797 rows: 1796 valid, 1 quarantined" in proc.stdout
    run_id = re.search(r"mlflow\s+run (\w+)", proc.stdout).group(1)
    run = MlflowClient(uri).get_run(run_id)
    assert run.data.tags["flyscale.dataset"] == "parquet:s3://features/digits/v1"
    assert run.data.metrics["validation_quarantined_rows"] == 1
    assert run.data.metrics["test_accuracy"] >= 0.95
    # The rejected row travels with the run: its values, its file and row there, and the reason.
    path = MlflowClient(uri).download_artifacts(run_id, "data/quarantine.parquet", str(tmp_path))
    (row,) = pd.read_parquet(path).itertuples()
    assert (row.row, row.source_file, row.source_row) == (7, "s3://features/digits/v1/part-0.parquet", 7)
    assert "pixel_12: in_range" in row.reason and "99" in row.reason and row.pixel_12 == 99.0
    report = MlflowClient(uri).download_artifacts(run_id, "data/validation/validation.html", str(tmp_path))
    assert "Quarantined rows per check" in open(report).read()
