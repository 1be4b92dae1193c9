"""The served-model stage: the candidate, saved as it would be registered, served on loopback
and load-tested (serving.loadtest), so that the gates can hold it to a latency target before it
is promoted."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, NamedTuple

from flytekit import task
from flytekit.types.directory import FlyteDirectory

from flyscale.config import ServingConfig
from flyscale.flyte.caching import LIBRARIES, code_cache
from flyscale.flyte.content import BY_CONTENT
from flyscale.flyte.outputs import output_dir
from flyscale.flyte.provenance import UNSTAMPED, TaskRun, stamped
from tasks.common import SMALL, TASK
from tasks.records import ExportedModel, ModelBundle, ServedLevel, ServedModel


class Served(NamedTuple):
    model: Annotated[ServedModel, BY_CONTENT]  # keyed by content downstream
    run: TaskRun = UNSTAMPED  # filled in by @stamped


@task(
    cache=code_cache("models", "objectives", libraries=(*LIBRARIES, "mlflow", "onnxruntime")),
    **TASK,
    requests=SMALL,
)
@stamped
def load_test_model(exported: ExportedModel, model: ModelBundle, cfg: ServingConfig) -> Served:
    """With serving.loadtest: the fp32 model saved as registration would log it, served by
    `cfg.setup` on loopback, each level of closed-loop clients measured (flyscale/serving). Off:
    nothing measured."""
    plots = output_dir("flyscale-loadtest-")
    if not cfg.loadtest:
        return Served(ServedModel("", [], FlyteDirectory(str(plots))))
    from flyscale.serving import compare_servers
    from flyscale.serving.repository import Batching
    from flyscale.tracking import model_log
    from flyscale.tracking.model_spec import spec_json

    tmp = Path(tempfile.mkdtemp(prefix="flyscale-candidate-"))
    export = exported.onnx.download() if exported.exported else ""
    files = model_log.ModelFiles(
        model.weights.download(),
        spec_json(model.model, model.info, None, model.objective),
        model.tokenizer_json(),
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
    return Served(ServedModel(cfg.setup, levels, FlyteDirectory(str(plots))))
