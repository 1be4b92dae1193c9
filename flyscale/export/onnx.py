"""The trained model as a file anyone can serve without flyscale: ONNX, from torch's exporter
(`torch.onnx.export(dynamo=True)`, which goes through `torch.export`), with a dynamic batch
dimension, and a dynamic sequence dimension for a model of token ids.

An export is only handed on once ONNX Runtime has answered like the PyTorch model on the test
split: the largest absolute difference of any output within `atol`, and the same prediction
(the highest-scoring class, or next token) on every example. A mismatch fails, naming the worst
example. A model torch cannot export gets a message naming the model and torch's reason.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from flyscale.train.objective import pairing

log = logging.getLogger(__name__)

ATOL = 1e-4  # fp32 kernels of two runtimes: reorderings leave differences near 1e-6


class ExportError(ValueError):
    """The model could not be exported, or its export does not answer like the model."""


@dataclass
class Parity:
    """How the exported model answered the test split, against the PyTorch model."""

    examples: int
    max_abs_diff: float
    worst_example: int  # the index in the test split of the example with the largest difference
    same_prediction: bool  # the same argmax on every example (and position), near-ties aside
    atol: float
    runtime: str = "ONNX Runtime"
    # Predictions where PyTorch's top two scores are within twice the tolerance of each other, and
    # the export's float noise picked the other: the same answer, ranked by noise.
    ties: int = 0

    def sentence(self) -> str:
        said = "the same prediction on every one" if self.same_prediction else "predictions differ"
        if self.same_prediction and self.ties:
            said += (
                f" but {self.ties:,} near-tie{'s' if self.ties > 1 else ''} (top two scores within twice the tolerance)"
            )
        return (
            f"{self.runtime} against PyTorch on {self.examples:,} test examples: max |difference| "
            f"{self.max_abs_diff:.2g} (example {self.worst_example}; tolerance {self.atol:g}), {said}"
        )


def model_inputs(x: torch.Tensor, y: torch.Tensor, objective: Any) -> torch.Tensor:
    """What the model is called with for a batch of the split (a language model: the tokens
    before each position)."""
    pair = pairing(objective)
    return pair(x, y)[0] if pair is not None else x


def _dynamic(example: torch.Tensor) -> dict[int, Any]:
    """The batch dimension dynamic, and the sequence too for token ids (up to the example's length)."""
    dims: dict[int, Any] = {0: torch.export.Dim("batch")}
    if not example.is_floating_point() and example.dim() == 2:  # token ids (N, T)
        dims[1] = torch.export.Dim("sequence", max=example.shape[1])
    return dims


class _SkippedTorchvision(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("torchvision is not installed")


@contextlib.contextmanager
def _exporter_quiet() -> Iterator[None]:
    """Two notes torch 2.13's exporter makes about torch itself, never about the model, silenced
    for the export: its op registry logs a WARNING for each torchvision op it skips when
    torchvision is not installed (flyscale never uses it); and `run_decompositions` deep-copies the
    program's module call graph, which constructs torch's deprecated `LeafSpec` and so raises
    LeafSpec's deprecation FutureWarning, about an isinstance check nobody here makes."""
    registry = logging.getLogger("torch.onnx._internal.exporter._registration")
    skipped = _SkippedTorchvision()
    registry.addFilter(skipped)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
            )
            yield
    finally:
        registry.removeFilter(skipped)


def cause(exc: BaseException) -> str:
    """What the exporter could not take, in one line: the operator ONNX has no function for, or
    torch.export's own reason with the module and line of the model's code it stopped at."""
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    for e in chain:
        found = re.search(r"No ONNX function found for <OpOverload\(op='([\w.]+)'", str(e))
        if found:
            return f"ONNX has no function for the operator {found.group(1)}{_where(chain)}"
    deepest = chain[-1]
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(deepest)).strip()
    reason = text.splitlines()[0].split("  (")[0] if text else ""  # without torch's notes on symbols
    return f"{type(deepest).__name__}: {reason}{_where(chain)}" if reason else type(deepest).__name__ + _where(chain)


def _where(chain: list[BaseException]) -> str:
    """Where in the model's own code the export stopped: ' (in Gated.forward, model.py:12)' from
    the deepest frame of a module outside torch, or the graph node being translated; '' if none."""
    place = ""
    for e in chain:
        tb = e.__traceback__
        while tb is not None:
            frame, owner = tb.tb_frame, tb.tb_frame.f_locals.get("self")
            node = frame.f_locals.get("node")
            stack = getattr(node, "meta", {}).get("nn_module_stack") if isinstance(node, torch.fx.Node) else None
            if stack:
                path, kind = list(stack.values())[-1]
                path = re.sub(r"^L\['self'\]\.?|^L__self__\.?", "", str(path))
                name = getattr(kind, "__name__", str(kind).rsplit(".", 1)[-1])
                place = f" (in the {name} at {path})" if path else f" (in the {name})"
            elif isinstance(owner, nn.Module) and not type(owner).__module__.startswith("torch."):
                code = frame.f_code
                place = f" (in {type(owner).__name__}.{code.co_name}, {Path(code.co_filename).name}:{tb.tb_lineno})"
            tb = tb.tb_next
    return place


def export(model: nn.Module, example: torch.Tensor, path: Path) -> Path:
    """Export `model` (eval mode) to ONNX at `path`, traced on `example` (a batch of its inputs):
    the batch dimension dynamic, and the sequence dimension too for integer token ids (up to
    the example's length)."""
    model = model.eval()
    dims = _dynamic(example)
    try:
        with _exporter_quiet():
            program = torch.onnx.export(
                model,
                (example,),
                dynamo=True,
                dynamic_shapes=(dims,),
                input_names=["input"],
                output_names=["output"],
                verbose=False,
            )
    # Only what the exporter raises for a model it cannot take (torch.export's capture, then the
    # translation, each wrapped in an OnnxExporterError): any other exception is a bug, and fails.
    except torch.onnx.errors.OnnxExporterError as exc:
        raise ExportError(
            f"the {type(model).__name__} could not be exported to ONNX by torch.onnx.export(dynamo=True): "
            f"{cause(exc)}. Rewrite that part for export (torch.cond for control flow on values; an operator "
            f"ONNX has), or set export.fallback: torch to register the PyTorch model, which loads where "
            f"flyscale and the model's plugin are installed"
        ) from exc
    if program is None:  # only when dynamo=False; kept for the type checker
        raise ExportError("torch.onnx.export returned no program")
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path))
    return path


class OnnxModule(nn.Module):
    """An ONNX file run by ONNX Runtime, called as the torch model it came from (torch tensors in
    and out): evaluation and the latency comparison measure a model as it will be served. Its
    threads do not spin between calls, so that two models timed in turn do not slow each other."""

    def __init__(self, path: Path | str):
        super().__init__()
        self.path = Path(path)
        self.runner = session(self.path, spinning=False)
        given = self.runner.get_inputs()[0]
        self.input_name = given.name
        from flyscale.export.onnx_pyfunc.predictor import ONNX_TYPES

        self.dtype = np.dtype(ONNX_TYPES.get(given.type, "float32"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.runner.run(None, {self.input_name: x.detach().cpu().numpy().astype(self.dtype, copy=False)})[0]
        return torch.from_numpy(out)

    def size_bytes(self) -> int:
        return self.path.stat().st_size


def has_convolutions(path: Path) -> bool:
    """Whether the ONNX file at `path` computes convolutions (what dynamic int8 leaves in fp32)."""
    import onnx

    return any(node.op_type.startswith("Conv") for node in onnx.load(str(path), load_external_data=False).graph.node)


def session(path: Path, spinning: bool = True):
    """An ONNX Runtime session on the CPU. `spinning` False: its threads sleep between calls
    instead of spinning for the next one, which otherwise holds the cores for a while after
    each call, and slows whatever runs beside it in the process (torch, another session)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: its warnings about unused initialisers are not ours
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@torch.no_grad()
def check_parity(
    model: nn.Module,
    path: Path,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    objective: Any,
    atol: float = ATOL,
) -> Parity:
    """Run the test split through the model and through its ONNX export; ExportError when any
    output differs by more than `atol`, or any prediction differs, naming the worst example. A
    prediction that differs only where PyTorch's top scores are within 2 `atol` of each other is
    a tie broken by float noise: counted (`Parity.ties`), not failed."""
    model = model.eval()
    answer = _answerer(path)
    kind = "ONNX model"
    worst, worst_at, seen, same, ties = 0.0, 0, 0, True, 0
    first_disagreement = -1
    for x, y in batches:
        if len(x) == 0:  # a shard with none of the split's rows
            continue
        inputs = model_inputs(x, y, objective)
        want = model(inputs).float().numpy()
        got = answer(inputs)
        if got.shape != want.shape:
            raise ExportError(f"the {kind} answers shape {got.shape} where the PyTorch model answers {want.shape}")
        diff = np.abs(got.astype(np.float64) - want).reshape(len(want), -1).max(axis=1)
        if not np.isfinite(diff).all():
            diff = np.where(np.isfinite(diff), diff, math.inf)
        i = int(diff.argmax())
        if diff[i] > worst or seen == 0:
            worst, worst_at = float(diff[i]), seen + i
        if want.ndim >= 2 and want.shape[-1] > 1:  # scores per class or token: compare the choice
            choice = got.argmax(-1)
            # How far below its own top score PyTorch puts the export's choice: within twice the
            # tolerance (each score may move by it), the two were tied and float noise broke the
            # tie the other way.
            margin = want.max(-1) - np.take_along_axis(want, choice[..., None], -1)[..., 0]
            tied = (choice != want.argmax(-1)) & (margin <= 2 * atol)
            ties += int(tied.sum())
            agree = (margin <= 2 * atol).reshape(len(want), -1).all(axis=1)
            if not agree.all():
                if same:
                    first_disagreement = seen + int(np.argmin(agree))
                same = False
        seen += len(want)
    parity = Parity(seen, worst, worst_at, same, atol, ties=ties)
    if worst > atol or not same:
        where = (
            f"example {first_disagreement} is predicted differently"
            if not same
            else f"example {worst_at} differs by {worst:.3g}, over the tolerance {atol:g}"
        )
        raise ExportError(f"the {kind} does not answer like the PyTorch model: {where} ({parity.sentence()})")
    log.info("%s", parity.sentence())
    return parity


def _answerer(path: Path):
    """What answers a batch of inputs (a tensor) as numpy: ONNX Runtime on the file."""
    runner = session(path)
    name = runner.get_inputs()[0].name
    return lambda inputs: runner.run(None, {name: inputs.numpy()})[0]


def serves_alone(objective: Any) -> bool:
    """Whether the objective's registered model can be its ONNX export (see `serving`)."""
    return getattr(objective, "serving", None) is not None or getattr(objective, "predict", None) is None


def serving(objective: Any, context: Any) -> dict | None:
    """How the ONNX model answers as the registered model (flyscale/export/onnx_pyfunc/), by the
    objective's `serving`; the raw outputs for an objective that serves nothing of its own; None
    for one with its own `predict` and no `serving` (only its PyTorch code knows what it returns)."""
    own = getattr(objective, "serving", None)
    if own is None:
        return {"output": "values", "scalar": False} if serves_alone(objective) else None
    described = dict(own(context))
    from flyscale.export.onnx_pyfunc.predictor import OUTPUTS

    if described.get("output") not in OUTPUTS:
        raise ExportError(
            f"the objective's serving() names output {described.get('output')!r}; it must be one of {list(OUTPUTS)}"
        )
    return described
