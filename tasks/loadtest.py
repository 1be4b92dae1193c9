"""The served-model stage: the candidate, saved as it would be registered, served on loopback
and load-tested (serving.loadtest), so that the gates can hold it to a latency target before it
is promoted."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, NamedTuple

from flytekit import task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from flyscale.config import ModelConfig, ObjectiveConfig, ServingConfig
from flyscale.flyte.caching import LIBRARIES, code_cache
from flyscale.flyte.content import BY_CONTENT
from flyscale.flyte.provenance import TaskRun
from flyscale.plugin.records import DatasetInfo
from tasks.common import SMALL, TASK
from tasks.records import ExportedModel, ServedLevel, ServedModel, keyed


class Served(NamedTuple):
    model: Annotated[ServedModel, BY_CONTENT]  # keyed by content downstream
    run: TaskRun


# The weights and the tokenizer enter the key by their sha256 (a record's field has no hash of its own).
@task(
    cache=code_cache(
        "models", "objectives", libraries=(*LIBRARIES, "mlflow", "onnxruntime"), ignored_inputs=("weights", "tokenizer")
    ),
    **TASK,
    requests=SMALL,
)
def load_test_model(
    exported: ExportedModel,
    weights: FlyteFile,
    weights_sha256: str,  # TrainedModel.sha256
    info: DatasetInfo,
    model_cfg: ModelConfig,
    cfg: ServingConfig,
    objective: ObjectiveConfig = ObjectiveConfig(),  # noqa: B008 (a Flyte input's default is its value)
    tokenizer: FlyteFile | None = None,
    tokenizer_sha256: str = "",  # ValidatedData.tokenizer_sha256
) -> Served:
    """With serving.loadtest: the fp32 model saved as registration would log it, served by
    `cfg.setup` on loopback, each level of closed-loop clients measured (flyscale/serving). Off:
    nothing measured."""
    run = TaskRun.start("load_test_model")
    keyed(weights, weights_sha256, "the weights")
    keyed(tokenizer, tokenizer_sha256, "the tokenizer")
    plots = Path(tempfile.mkdtemp(prefix="flyscale-loadtest-"))
    if not cfg.loadtest:
        return Served(ServedModel("", [], FlyteDirectory(str(plots))), run.done())
    from flyscale.serving import compare_servers
    from flyscale.serving.repository import Batching
    from flyscale.tracking import model_log
    from flyscale.tracking.model_spec import spec_json

    tmp = Path(tempfile.mkdtemp(prefix="flyscale-candidate-"))
    tokenizer_json = Path(tokenizer.download()).read_text() if tokenizer is not None else ""
    export = exported.onnx.download() if exported.exported else ""
    files = model_log.ModelFiles(
        weights.download(),
        spec_json(model_cfg, info, None, objective),
        tokenizer_json,
        onnx_path=export,
        limits=cfg.limits(),
    )
    model_log.save_model(files, str(tmp / "model"), str(tmp))
    target = compare_servers.local_target(tmp / "model", "candidate")
    batching = Batching(cfg.max_batch_size, cfg.max_delay_ms)
    (report,) = compare_servers.run(
        target, [cfg.setup], cfg.levels, cfg.requests, batching, Path(cfg.envs).expanduser()
    )
    compare_servers.figure([report]).savefig(plots / "latency_throughput.png", dpi=100)
    levels = [
        ServedLevel(lv.concurrency, lv.requests, lv.errors, lv.p50_ms, lv.p99_ms, lv.throughput) for lv in report.levels
    ]
    return Served(ServedModel(cfg.setup, levels, FlyteDirectory(str(plots))), run.done())
