"""What the stages hand each other, besides the splits: one typed record per stage.

A workflow passes a record whole (registration takes them all) or one field of it
(`validated.info`), which Flyte resolves without running anything. Files travel as FlyteFile
and FlyteDirectory fields, uploaded and downloaded by Flyte, never behind its back.

A task returns each record `Annotated[..., BY_CONTENT]`: a task that takes it whole is keyed on
its content, not on where its files were written. A file taken out of a record (`exported.onnx`)
enters a key by the sha256 beside it (`exported.sha256`), the file itself an ignored input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile
from torch import nn

from flyscale.config import ModelConfig, ObjectiveConfig
from flyscale.data.reference import Profile
from flyscale.data.shards import Shards
from flyscale.data.source import DataFingerprint
from flyscale.data.tokenize import TokenStats
from flyscale.data.validation import ValidationReport
from flyscale.evaluate.comparison import Comparison
from flyscale.evaluate.metrics import EvalMetrics
from flyscale.flyte.content import file_sha256
from flyscale.model import build_model, load_state
from flyscale.plugin.records import DatasetInfo


def keyed(file: FlyteFile | None, sha256: str, name: str) -> None:
    """Refuse a file whose task's cache key would hold nothing of it: a file taken out of a record
    (which carries no content hash of its own) is an ignored input, and enters the key by the
    sha256 passed beside it."""
    assert file is None or sha256, f"{name} came without its sha256: the task's cache key would not hold it"


@dataclass
class StartWeights:
    """What training starts from (`model.init_from`): the weights (None: fresh ones), their sha256
    (what training's cache keys on), and what they are, for the lineage."""

    weights: FlyteFile | None = None
    sha256: str = ""
    source: str = ""


@dataclass
class ModelCheck:
    """The model the run will train, checked against its strategy before any data was read, and
    the weights it starts from, checked against it."""

    model: str
    strategy: str
    world_size: int
    parameters: int
    layers: list[str]  # the top-level layers, by type
    start: StartWeights = field(default_factory=StartWeights)


@dataclass
class ValidatedData:
    """What validation found, whichever data branch ran: the info every later stage uses (held to
    the reference), the quarantine and the report, the data's profile and fingerprint."""

    info: DatasetInfo
    content: DataFingerprint  # the fingerprint of the data as loaded: what a model is said to be trained on
    report: ValidationReport
    quarantined: Shards  # every rejected row, with where it came from and why
    profile: Profile
    report_files: FlyteDirectory  # the validation report (HTML and its plot), as a person reads it
    # Text only: how the documents became the packed sequences `info` describes, and the tokenizer
    # (its JSON), which a model of them carries.
    tokens: TokenStats | None = None
    tokenizer: FlyteFile | None = None
    tokenizer_sha256: str = ""  # what the cache keys of the tasks that take `tokenizer` hold of it


@dataclass
class ModelBundle:
    """The trained model as every stage after training takes it, in one record: the weights (a
    state_dict file), what they are the weights of (the model's config, and the dataset info it
    was built from), the objective that reads its outputs, and for text the tokenizer whose ids
    it reads. `module()` is the one way back to a torch module.

    Training returns it keyed by content: a stage that takes it whole keys on the weights' bytes,
    the configs and the tokenizer's bytes, never on where the files were written."""

    weights: FlyteFile
    weights_sha256: str
    info: DatasetInfo
    model: ModelConfig
    objective: ObjectiveConfig
    tokenizer: FlyteFile | None = None  # text: the tokenizer's JSON

    def module(self) -> nn.Module:
        """The model with these weights, in eval mode (checked against their sha256 first)."""
        path = self.weights.download()
        if file_sha256(path) != self.weights_sha256:
            raise ValueError(f"the weights at {path} are not those their sha256 says ({self.weights_sha256[:12]})")
        return load_state(build_model(self.model, self.info), path)

    def tokenizer_json(self) -> str:
        """The tokenizer's JSON ("" where the model reads no text)."""
        return Path(self.tokenizer.download()).read_text() if self.tokenizer is not None else ""


@dataclass
class EvaluatedModel:
    """The fp32 model's test metrics, and the fingerprint of the test split they were measured on."""

    metrics: EvalMetrics
    test_sha256: str


@dataclass
class ExportedModel:
    """The fp32 model as ONNX, and how it answered the test split against the PyTorch model."""

    onnx: FlyteFile  # the export (see `format`); empty when there is none (then sha256 is "")
    sha256: str
    parity: str  # the sentence the summary and MLflow show, or "not exported: <torch's reason>"
    max_abs_diff: float
    # "onnx"; "" for none (export.fallback torch: the PyTorch model is registered)
    format: str = "onnx"

    @property
    def exported(self) -> bool:
        return bool(self.sha256)


@dataclass
class QuantizedModel:
    """The int8 model's weights and metrics, measured side by side with the fp32 one, and the
    run's figures (drawn once, for the Deck and for MLflow)."""

    weights: FlyteFile  # the int8 ONNX file (format "onnx"), or a torch quantizer's int8 state_dict
    metrics: EvalMetrics
    comparison: Comparison
    plots: FlyteDirectory
    format: str = "onnx"
    quantizer: str = ""  # the quantizer that made it (the configured one, or the torch fallback)


@dataclass
class ServedLevel:
    concurrency: int
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    throughput: float


@dataclass
class ServedModel:
    """The candidate served on loopback under load (serving.loadtest), before the gates: each
    level's numbers, and the plot of them (an empty folder when the load test is off)."""

    setup: str  # "" when the load test is off
    levels: list[ServedLevel]
    plots: FlyteDirectory

    def scalars(self) -> dict[str, float]:
        """What the gates see and MLflow records: served_c<clients>_latency_p99_ms, ..."""
        from flyscale.serving.loadtest import scalars

        return scalars(self.levels, "served")
