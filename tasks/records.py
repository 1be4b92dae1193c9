"""What the stages hand each other, besides the splits: one typed record per stage.

A workflow passes a record whole (registration takes them all) or one field of it
(`validated.info`), which Flyte resolves without running anything. Files travel as FlyteFile
and FlyteDirectory fields, uploaded and downloaded by Flyte, never behind its back.
"""

from __future__ import annotations

from dataclasses import dataclass

from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from flyscale.data.reference import Profile
from flyscale.data.shards import Shards
from flyscale.data.source import DataFingerprint
from flyscale.data.tokenize import TokenStats
from flyscale.data.validation import ValidationReport
from flyscale.evaluate.comparison import Comparison
from flyscale.evaluate.metrics import EvalMetrics
from flyscale.plugin.contracts import DatasetInfo
from flyscale.train.telemetry import TrainHistory


@dataclass
class ModelCheck:
    """The model the run will train, checked against its strategy before any data was read."""

    model: str
    strategy: str
    world_size: int
    parameters: int
    layers: list[str]  # the top-level layers, by type


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


@dataclass
class TrainedModel:
    """The trained weights (a state_dict file) and how training went."""

    weights: FlyteFile
    history: TrainHistory


@dataclass
class EvaluatedModel:
    """The fp32 model's test metrics, and the fingerprint of the test split they were measured on."""

    metrics: EvalMetrics
    test_sha256: str


@dataclass
class QuantizedModel:
    """The int8 model's weights and metrics, measured side by side with the fp32 one, and the
    run's figures (drawn once, for the Deck and for MLflow)."""

    weights: FlyteFile
    metrics: EvalMetrics
    comparison: Comparison
    plots: FlyteDirectory
