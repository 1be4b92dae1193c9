"""The export stage: the trained fp32 model as ONNX, checked against PyTorch on the test split."""

from __future__ import annotations

import logging
from typing import Annotated, NamedTuple

from flytekit import task
from flytekit.types.file import FlyteFile

from flyscale.config import ExportConfig
from flyscale.data.shards import Shards
from flyscale.data.tensors import batches
from flyscale.export import onnx
from flyscale.flyte.caching import code_cache
from flyscale.flyte.content import BY_CONTENT
from flyscale.flyte.outputs import output_dir
from flyscale.flyte.provenance import UNSTAMPED, TaskRun, stamped
from flyscale.model import file_sha256
from flyscale.train import objective as objectives
from tasks.common import SMALL, TASK
from tasks.records import ExportedModel, ModelBundle

log = logging.getLogger(__name__)


class Exported(NamedTuple):
    model: Annotated[ExportedModel, BY_CONTENT]  # keyed by content downstream, its file by `sha256`
    run: TaskRun = UNSTAMPED  # filled in by @stamped


@task(cache=code_cache("models", "objectives"), **TASK, requests=SMALL)
@stamped
def export_model(
    model: ModelBundle,
    test: Shards,
    export: ExportConfig = ExportConfig(),  # noqa: B008 (a Flyte input's default is its value)
) -> Exported:
    """Export the trained model to ONNX (dynamic batch; dynamic sequence for token ids), and
    fail unless ONNX Runtime answers the test split as the PyTorch model does. A model ONNX
    cannot take fails here, naming why; with export.fallback torch it is handed on without an
    export (an empty file, no sha256), with the reason, and the PyTorch model is registered."""
    module, info = model.module(), model.info
    goal = objectives.of(model.objective)
    x, y = next(iter(batches(test, info)))
    path = output_dir("flyscale-onnx-") / "model.onnx"
    example = onnx.model_inputs(x[:8], y[:8], goal)  # traced on a few rows; any batch size serves
    try:
        onnx.export(module, example, path)
    except onnx.ExportError as exc:
        if export.fallback != "torch":
            raise
        # Chosen in config: the PyTorch model is registered (weights_only state_dict, flyscale's code).
        log.warning("%s; export.fallback torch: the PyTorch model is registered", exc)
        path.write_bytes(b"")
        return Exported(ExportedModel(FlyteFile(str(path)), "", f"not exported: {exc}", 0.0, ""))
    # An export that answers differently is a bug to fix, not a model to ship: that fails here.
    parity = onnx.check_parity(module, path, batches(test, info), goal)
    exported = ExportedModel(
        FlyteFile(str(path)), file_sha256(str(path)), parity.sentence(), parity.max_abs_diff, "onnx"
    )
    return Exported(exported)
