"""Batch prediction: a dataset's rows scored by a registered version, one piece of the dataset
(a file of rows, or a shard of typed examples such as images) at a time, each written as
Parquet beside its input key. Images are decoded and scaled as training reads them; documents,
for a classifier trained on labelled text, are tokenized by the tokenizer the version carries,
as training tokenized them.

A piece's output has one row per input row, in order: the origin (`_source_file`,
`_source_row`: the input key), `model` (models:/NAME/VERSION, the version that scored it),
`prediction` (the class for a classifier, the value for a regressor), and for a classifier
`scores` (its class probabilities). A row the model cannot score (a missing or non-numeric
feature) is never dropped: scoring fails naming the column, the file and the row.

Only a version flyscale registered is scored, and nothing of it is unpickled or run: its MLmodel
file is read first, and a pickled flavour (pytorch, sklearn, a cloudpickled python_model), or
code of anyone else's, is refused before anything is loaded. The version's data files (the ONNX
file and its serving JSON; or, registered with export.fallback torch, the state_dict loaded with
weights_only and its spec) are then run by this flyscale's own code, never by the code file the
version carries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from flyscale.config import DataConfig
from flyscale.data import fields, source
from flyscale.plugin.data_kind import DataKind, declared_kind
from flyscale.plugin.records import SOURCE_FILE, SOURCE_PROBLEM, SOURCE_ROW, DatasetInfo, as_dataset_info

log = logging.getLogger(__name__)


class BatchPredictError(ValueError):
    """The dataset cannot be scored by the model as it is."""


def parts(cfg: DataConfig) -> list[str]:
    """The pieces of the configured dataset batch prediction maps over: a dataset of rows' files
    (`parts`), or a dataset of typed examples' shards (`shards`; one piece without)."""
    resolved = cfg.plugin
    listed, read = resolved.method("parts"), resolved.method("part")
    if listed is not None and read is not None:
        found = list(listed(resolved.options))
    elif declared_kind(resolved) is DataKind.EXAMPLES:
        found = source.shards(cfg)
    else:
        raise BatchPredictError(
            f"dataset {cfg.dataset!r} says neither what pieces its rows come in (parts() and part()) nor its "
            "examples' shards (examples()): batch prediction reads the parquet and csv datasets (local or s3://) "
            "and datasets of typed examples"
        )
    if not found:
        raise BatchPredictError(f"dataset {cfg.dataset!r} has nothing to score under its path")
    return found


@dataclass
class Scored:
    rows: int
    path: str


# The code files flyscale registers its models with (models from code): the ONNX-served model
# (python_model.py; served.py in versions registered before flyscale/export/onnx_pyfunc/ was a
# package), and the PyTorch one (export.fallback torch). Each needs these artifacts.
ONNX_ARTIFACTS = ("onnx", "serving", "spec")
CODE = {"python_model.py": ONNX_ARTIFACTS, "served.py": ONNX_ARTIFACTS, "model_code.py": ("weights", "spec")}
ROWS = 1024  # rows a call of the PyTorch model, which holds no limit of its own


def load(model_uri: str, into: Path) -> tuple[Any, DatasetInfo]:
    """The registered model (downloaded into `into`, its MLmodel file checked, then its data
    files run by flyscale's own code) and the dataset info it was trained on, from its spec."""
    import json

    import mlflow

    from flyscale.tracking.model_spec import artifact_files
    from flyscale.tracking.store import quiet_artifacts

    with quiet_artifacts():  # a task's download: nobody watches its progress bars
        local = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(into)))
    code = _flyscale_code(model_uri, local)  # before anything of it is loaded
    files = artifact_files(local)
    serving = files.get("serving")
    if serving and json.loads(serving.read_text()).get("output") == "text":
        raise BatchPredictError(
            f"{model_uri} is a language model (prompts in, text out): batch prediction scores examples"
        )
    spec = json.loads(files["spec"].read_text())
    return _model(code, files, spec), as_dataset_info(spec["info"], f"{model_uri}'s spec")


def reads_documents(model: Any) -> bool:
    """Whether the loaded version is a classifier of text: it takes documents and tokenizes them."""
    from flyscale.export.onnx_pyfunc.predictor import Served

    return isinstance(model, Served) and model.text is not None


def _flyscale_code(model_uri: str, local: Path) -> str:
    """Which of flyscale's models the downloaded version is (a key of CODE), read from its MLmodel
    file alone; BatchPredictError naming what it is otherwise."""
    import yaml

    mlmodel = local / "MLmodel"
    if not mlmodel.is_file():
        raise BatchPredictError(f"{model_uri} is not an MLflow model (no MLmodel file)")
    flavors = yaml.safe_load(mlmodel.read_text()).get("flavors") or {}
    pyfunc = flavors.get("python_function") or {}
    code = Path(str(pyfunc.get("model_code_path") or "")).name
    others = sorted(set(flavors) - {"python_function"})
    if others or pyfunc.get("loader_module") != "mlflow.pyfunc.loaders.code_model" or code not in CODE:
        what = f"flavours {sorted(flavors)}" + (
            f", python_model {pyfunc['python_model']}" if "python_model" in pyfunc else ""
        )
        raise BatchPredictError(
            f"{model_uri} is not a model flyscale registered ({what}): batch prediction loads only flyscale's "
            f"pickle-free models (an ONNX file and its serving JSON, or a state_dict and its spec) and never "
            f"unpickles or runs a model's own code"
        )
    missing = [a for a in CODE[code] if a not in (pyfunc.get("artifacts") or {})]
    if missing:
        raise BatchPredictError(f"{model_uri} lacks the artifacts {missing} a flyscale model carries")
    return code


class _PyTorchModel:
    """A version registered as the PyTorch model, built by flyscale's plugins (weights_only)."""

    def __init__(self, files: dict[str, Path], spec: dict):
        from flyscale.tracking.model_spec import build, objective_of

        self.model = build(spec, str(files["weights"]))
        self.objective, self.context = objective_of(spec, "")
        self.limits = {"max_rows": ROWS}

    def predict(self, x: np.ndarray) -> Any:
        from flyscale.tracking.model_io import predict

        return predict(self.objective, self.model, x, None, self.context)


def _model(code: str, files: dict[str, Path], spec: dict) -> Any:
    """What scores a batch (`predict(x)`, and `limits["max_rows"]`), by flyscale's code."""
    if code == "model_code.py":
        return _PyTorchModel(files, spec)
    from flyscale.export.onnx_pyfunc.predictor import load

    tokenizer = files.get("tokenizer")  # a classifier of text tokenizes the documents it scores
    return load(str(files["onnx"]), str(files["serving"]), str(tokenizer) if tokenizer else None)


def _inputs(cfg: DataConfig, name: str, info: DatasetInfo) -> Iterator[tuple[pd.DataFrame, np.ndarray]]:
    """(origin columns, the model's inputs) of the piece `name`, a batch at a time."""
    resolved = cfg.plugin
    field = info.input()
    if field is None:  # columns of features
        for frame in resolved.plugin.part(resolved.options, name):
            missing = [c for c in info.feature_columns if c not in frame.columns]
            if missing:
                raise BatchPredictError(
                    f"{name}: the model reads features {missing[:5]}{'...' if len(missing) > 5 else ''} "
                    f"that the file does not have"
                )
            yield frame[[SOURCE_FILE, SOURCE_ROW]], _numeric(frame, info.feature_columns, name)
        return
    reader = fields.reader(info)
    for batch in source.examples(cfg, name):
        table = pa.Table.from_batches([batch])
        origin = table.select([SOURCE_FILE, SOURCE_ROW]).to_pandas()
        if field.name not in table.column_names:
            raise BatchPredictError(f"shard {name!r}: the model reads field {field.name!r}, which its examples lack")
        column = table.column(field.name)
        if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):  # encoded images
            x = np.empty((table.num_rows, *field.shape), dtype="uint8")
            for i, data in enumerate(column.to_pylist()):
                try:
                    x[i] = fields.decode_image(data, field)
                except ValueError as exc:
                    at = origin.iloc[i]
                    raise BatchPredictError(f"{at[SOURCE_FILE]} row {at[SOURCE_ROW]}: {field.name} {exc}") from None
        else:
            x = fields.to_numpy(column, field)
        yield origin, reader.to_model(x)


def score_part(cfg: DataConfig, name: str, model_uri: str, out: Path) -> Scored:
    """Score the piece `name` of the dataset with the model at `model_uri`; Parquet at `out`."""
    model, info = load(model_uri, out.parent / "model")
    writer: pq.ParquetWriter | None = None
    rows = 0
    pieces = (
        _documents(cfg, name, model.limits["max_prompt_chars"]) if reads_documents(model) else _inputs(cfg, name, info)
    )
    try:
        for origin, x in pieces:
            answer = _answers(model, x)
            table = _table(origin, answer, model_uri)
            if writer is None:
                writer = pq.ParquetWriter(str(out), table.schema)
            writer.write_table(table)
            rows += len(origin)
    finally:
        if writer is not None:
            writer.close()
    if writer is None:  # an empty file: an empty output, with the columns
        pq.write_table(pa.table({SOURCE_FILE: pa.array([], pa.string()), SOURCE_ROW: pa.array([], pa.int64())}), out)
    log.info("%s: %d rows scored by %s", name, rows, model_uri)
    return Scored(rows, str(out))


def _documents(cfg: DataConfig, name: str, chars: int) -> Iterator[tuple[pd.DataFrame, np.ndarray]]:
    """(origin columns, the documents as strings) of the shard `name` of a dataset of documents,
    each cut at `chars` characters (what the served model reads of one; it tokenizes far fewer);
    a document that is not UTF-8 text, or is empty, stops the scoring naming its file and row."""
    field = source.info(cfg).input()
    if field is None or field.dtype != "string":
        raise BatchPredictError(
            f"the version is a classifier of text (it reads documents); dataset {cfg.dataset!r} has "
            f"{field if field is not None else 'a table of features'}, not documents"
        )
    for batch in source.examples(cfg, name):
        table = pa.Table.from_batches([batch])
        origin = table.select([SOURCE_FILE, SOURCE_ROW]).to_pandas()
        n = table.num_rows
        problems = table.column(SOURCE_PROBLEM).to_pylist() if SOURCE_PROBLEM in table.column_names else [None] * n
        docs = np.empty(n, dtype=object)
        for i, value in enumerate(table.column(field.name).to_pylist()):
            text, why = _document(value, problems[i])
            if why:
                at = origin.iloc[i]
                raise BatchPredictError(f"{at[SOURCE_FILE]} row {at[SOURCE_ROW]}: {field.name} {why}, nothing to score")
            docs[i] = text[:chars]
        yield origin, docs


def _document(value: Any, problem: str | None) -> tuple[str, str]:
    """(the document's text, "") or ("", why it cannot be scored). `problem` is what the dataset
    said of the example: why its text is missing (a line over its cap, one that is not JSON), or
    something of no matter here (its class, in a labelled dataset)."""
    if value is None:
        return "", f"could not be read ({problem})" if problem else "is missing"
    try:
        text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as exc:
        return "", f"is not UTF-8 (byte {exc.start})"
    return (text, "") if text.strip() else ("", "is an empty document")


def _answers(model: Any, x: np.ndarray) -> np.ndarray:
    """The model's answer for each row; NaN for a row with a missing value, which the served
    model refuses, so that every row is still scored in order (none, for an empty file, which
    the served model refuses too)."""
    most = int(model.limits["max_rows"])  # what one request may ask of the served model
    if len(x) > most:
        return np.concatenate([_answers(model, x[i : i + most]) for i in range(0, len(x), most)])
    if x.dtype == object:  # documents, checked as they were read
        return np.asarray(model.predict(x))
    finite = np.isfinite(x).reshape(len(x), -1).all(axis=1) if len(x) else np.zeros(0, dtype=bool)
    if len(x) and finite.all():
        return np.asarray(model.predict(x))
    # Asked of the complete rows, or of one row of zeros when none is: the answer's shape.
    asked = np.asarray(model.predict(x[finite] if finite.any() else np.zeros((1, *x.shape[1:]), x.dtype)))
    out = np.full((len(x), *asked.shape[1:]), np.nan, dtype=np.result_type(asked.dtype, np.float32))
    out[finite] = asked[: int(finite.sum())]
    return out


def _numeric(frame: pd.DataFrame, features: list[str], name: str) -> np.ndarray:
    """The features as float32, or an error naming the first column and row that is not a number."""
    block = frame[features].apply(pd.to_numeric, errors="coerce")
    bad = block.isna() & frame[features].notna()
    if bad.to_numpy().any():
        column = bad.any().idxmax()
        row = int(frame.loc[bad[column], SOURCE_ROW].iloc[0])
        raise BatchPredictError(
            f"{name}: column {column!r} at row {row} is not a number: {frame.loc[bad[column], column].iloc[0]!r}"
        )
    return block.to_numpy(dtype="float32")


def _table(frame: pd.DataFrame, answer: np.ndarray, model_uri: str) -> pa.Table:
    columns: dict[str, Any] = {
        SOURCE_FILE: pa.array(frame[SOURCE_FILE].astype(str).to_numpy()),
        SOURCE_ROW: pa.array(frame[SOURCE_ROW].to_numpy(dtype="int64")),
        "model": pa.array([model_uri] * len(frame)),
    }
    if answer.ndim == 2 and answer.shape[1] > 1:  # class probabilities
        columns["prediction"] = pa.array(answer.argmax(axis=1).astype("int64"))
        columns["scores"] = pa.array(list(answer.astype("float32")), pa.list_(pa.float32()))
    else:
        columns["prediction"] = pa.array(answer.reshape(len(frame)).astype("float64"))
    return pa.table(columns)
