"""The sections for what happens after training: the gates, quantization and MLflow."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from flyscale.config.base import Section, positive, section
from flyscale.config.plugins import PluginSection


@section
class GateConfig(PluginSection):
    """One evaluation gate: a gate plugin and its options."""

    _section = "gate"
    _kind = "gates"
    name: str = "min_metric"
    options: dict = field(default_factory=dict)  # the gate's own; its defaults live in its options dataclass

    def __post_init__(self):
        self._canonical()  # resolving is the validation: an unknown name or a bad option fails here


def _default_gates() -> list[GateConfig]:
    # beats_champion by default: a run that is not better than the champion never replaces it
    # (a sweep leaves the best; a rerun of an old config moves nothing). Going back is
    # `flyscale rollback`'s.
    return [GateConfig("min_metric"), GateConfig("beats_champion"), GateConfig("quantization")]


@section
class GatesConfig(Section):
    """Every gate a model must pass before it is published; each verdict is recorded.

    In YAML `gate:` is a list of gates (`- {name: min_metric}`), or one gate as a mapping
    (`gate: {name: beats_champion}`), which is a list of one.
    """

    _section = "gate"
    gates: list[GateConfig] = field(default_factory=_default_gates)

    def __post_init__(self):
        names = [g.name for g in self.gates]
        if len(set(names)) != len(names):
            raise ValueError(f"gate: a gate is listed twice in {names}; give each once, with all its options")

    @staticmethod
    def normalise(data: Any) -> Any:
        """A list of gates, or one gate's mapping, as the {"gates": [...]} this section holds."""
        if isinstance(data, list):
            return {"gates": data}
        if isinstance(data, dict) and data and "gates" not in data:
            return {"gates": [data]}
        return data


@section
class QuantizeConfig(PluginSection):
    """Post-training quantization: which quantizer, with which options."""

    _section = "quantize"
    _kind = "quantizers"
    name: str = "dynamic_int8"
    options: dict = field(default_factory=dict)
    # How much accuracy int8 may cost is the `quantization` gate's: gate: [..., {name: quantization,
    # options: {max_accuracy_drop: 0.01}}].
    # When the int8 model is registered as the `-int8` twin: "if_it_pays" (smaller on disk, and
    # faster by the geometric mean of the speed-ups timed; a convolutional model that does not pay
    # is tried with static_int8 too), or "always".
    twin: str = "if_it_pays"

    def __post_init__(self):
        if self.twin not in ("if_it_pays", "always"):
            raise ValueError(f"quantize.twin must be 'if_it_pays' or 'always', got {self.twin!r}")
        self._canonical()  # resolving is the validation: an unknown name or a bad option fails here


@section
class MlflowConfig(Section):
    """Where runs and models go. The tracking URI comes from MLFLOW_TRACKING_URI, else ./mlflow.db."""

    _section = "mlflow"
    experiment: str = "flyscale"
    # "": named after the data, filled in by PipelineConfig (`default_model_name`): one registered
    # name per kind of model, so that another dataset's model never takes this one's champion.
    model_name: str = ""
    alias: str = "champion"
    # "auto": a model that passes every gate becomes `alias` (compare-and-set). "manual": it becomes
    # `challenger_alias`, and a person moves `alias` with `flyscale promote` after looking.
    promotion: str = "auto"
    challenger_alias: str = "challenger"
    # Every MLflow request is retried this many times with exponential backoff (factor in
    # seconds) before the run fails with a retryable error; MLflow's own default is ~4 minutes.
    retries: int = 3
    retry_backoff_s: int = 1
    request_timeout_s: int = 30
    lock_timeout_s: float = 120.0  # how long to wait for another run that is moving the alias
    lock_stale_s: float = 600.0  # a promotion lock older than this was left by a dead run
    # A model whose inputs or objective differ from those of the model registered under
    # `model_name` is refused before training (flyscale/tracking/kind.py): clients of the name
    # send what it takes. True registers it under the name anyway, to replace that kind.
    replace_kind: bool = False

    def __post_init__(self):
        for name in ("experiment", "alias", "challenger_alias"):
            if not getattr(self, name).strip():
                raise ValueError(f"mlflow.{name} must not be empty")
        if self.model_name != self.model_name.strip() or "/" in self.model_name or ":" in self.model_name:
            raise ValueError(
                f"mlflow.model_name {self.model_name!r}: no '/', ':' or surrounding spaces (MLflow's model URIs "
                f"read models:/<name>@<alias>); leave it out for the default, named after the data"
            )
        if self.promotion not in ("auto", "manual"):
            raise ValueError(f"mlflow.promotion must be 'auto' or 'manual', got {self.promotion!r}")
        if self.challenger_alias == self.alias:
            raise ValueError(f"mlflow.challenger_alias must differ from mlflow.alias ({self.alias!r})")
        if self.retries < 0:
            raise ValueError(f"mlflow.retries must be >= 0, got {self.retries}")
        positive(self, "retry_backoff_s", "request_timeout_s", "lock_timeout_s", "lock_stale_s")


def default_model_name(dataset: str, objective: str, natural_objective: str) -> str:
    """The registered name a run gets when its config names none: `flyscale-<dataset>`, and
    `-<objective>` when that is not the objective the dataset is for (its plugin's `objective`):
    flyscale-digits, flyscale-image-folder, flyscale-python-docs, flyscale-text-classification.
    One kind of data, one name: a model of other data never competes for another's champion."""
    name = f"flyscale-{dataset}"
    if objective != natural_objective:
        name += f"-{objective}"
    return name.replace("_", "-")


EXPORT_FALLBACKS = ("none", "torch")


@section
class ExportConfig(Section):
    """How the trained model becomes the file that is served (flyscale/export/onnx.py)."""

    _section = "export"
    # What a model ONNX cannot take becomes. "none": the export fails, naming the operator or the
    # module and torch's reason. "torch": the PyTorch model is registered instead (its weights as
    # a state_dict, loaded with weights_only; flyscale and the model's plugin where it is served).
    # No torch.export program (.pt2): torch.export.load may unpickle, and runs code from the file.
    fallback: str = "none"

    def __post_init__(self):
        if self.fallback not in EXPORT_FALLBACKS:
            raise ValueError(f"export.fallback must be one of {list(EXPORT_FALLBACKS)}, got {self.fallback!r}")


SERVING_SETUPS = ("mlflow", "mlserver", "mlserver-batching")
# What one request to the served model may ask, by default (flyscale/export/onnx_pyfunc/predictor.py holds the
# same numbers for models registered before their limits were written into them).
REQUEST_LIMITS = ("max_rows", "max_prompts", "max_prompt_chars", "max_new_tokens", "time_budget_s")


@section
class ServingConfig(Section):
    """The served-model check: the candidate, as it would be registered, served on loopback and
    load-tested before the gates, which may then bound what it measured (the `served` gate)."""

    _section = "serving"
    loadtest: bool = False
    # The server (flyscale/serving/compare_servers.py): mlflow (no batching), mlserver (batching off) or
    # mlserver-batching.
    setup: str = "mlserver-batching"
    levels: list = field(default_factory=lambda: [1, 4, 16, 64])  # concurrent clients, one level each
    requests: int = 200  # a level
    max_batch_size: int = 32
    max_delay_ms: float = 5.0
    envs: str = "~/.cache/flyscale/serving"  # where the server's environment is built (uv), once
    # What one request may ask of the served model: written into the model (its serving JSON), so
    # every server that loads it enforces them; past one, HTTP 400 naming the field.
    max_rows: int = 1024  # examples in one request
    max_prompts: int = 64  # prompts in one request to a language model
    max_prompt_chars: int = 65536  # characters in one prompt (its tokens are bounded by the context)
    max_new_tokens: int = 1024  # tokens one request may ask a language model for
    # Generation stops past this and the request is refused (HTTP 400): keep it below the server's
    # request timeout (MLflow's MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT, 60 s), which does not stop the work.
    time_budget_s: float = 30.0

    def limits(self) -> dict:
        """The request limits, as the served model's serving JSON holds them."""
        return {name: getattr(self, name) for name in REQUEST_LIMITS}

    def __post_init__(self):
        if self.setup not in SERVING_SETUPS:
            raise ValueError(f"serving.setup must be one of {list(SERVING_SETUPS)}, got {self.setup!r}")
        if not self.levels or any(not isinstance(c, int) or c < 1 for c in self.levels):
            raise ValueError(f"serving.levels must be concurrencies >= 1, got {self.levels}")
        positive(self, "requests", "max_batch_size", *REQUEST_LIMITS)
        if self.max_batch_size > self.max_rows:  # MLServer batches requests into one call of the model
            raise ValueError(
                f"serving.max_batch_size {self.max_batch_size} exceeds serving.max_rows {self.max_rows}: a batch "
                f"of requests would be refused as one; lower it, or raise serving.max_rows"
            )
        if self.max_delay_ms < 0:
            raise ValueError(f"serving.max_delay_ms must be >= 0, got {self.max_delay_ms}")
