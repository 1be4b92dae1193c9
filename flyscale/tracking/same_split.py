"""The champion judged on the candidate's data: its registered model scored on this run's test split.

A champion's recorded metrics come from its own test split; new data, a new seed or a warm start
give a candidate another one, and two numbers from two splits say little about which model is
better. So a gate that compares with the champion (`compares_champion`) gets the champion's
metrics on the candidate's split, measured the way they will be served: the registered model,
loaded with mlflow.pyfunc (`models:/<name>/<version>`, the self-contained model MLflow serves),
is called with the float inputs the candidate's own evaluation read, and its answers go through
the objective's evaluator, as the candidate's outputs did.

Scoring needs the two models to be of one kind (flyscale/tracking/kind.py): a champion that takes
other inputs, has another objective or (a language model) another tokenizer cannot be scored
here, and the ChampionRef says why; the gate then fails closed or does what its options say.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from flyscale.config import MlflowConfig
from flyscale.evaluate.gating import ChampionRef
from flyscale.plugin.records import ObjectiveContext
from flyscale.tracking import kind as kinds
from flyscale.tracking.store import client_settings, mlflow_errors, tracking_uri

log = logging.getLogger(__name__)

# The store failing is not "this champion cannot be scored": those fail the run, retryably.
NOT_THERE = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND")


class RegisteredModule(nn.Module):
    """A registered model called as the torch model evaluation scores: what it answers to the
    float inputs evaluation reads, as the scores the objective's evaluator takes. A classifier's
    probabilities become log-probabilities (the same argmax, softmax and cross-entropy as its
    scores); a regressor's values are used as they are; a language model answers prompts with
    text, so its next-token scores come from the network it serves, on the split's token ids."""

    def __init__(self, pyfunc: Any):
        super().__init__()
        self.pyfunc = pyfunc
        inner = pyfunc.unwrap_python_model()
        self.served = getattr(inner, "served", None)  # flyscale/export/onnx_pyfunc/python_model.py's model
        self.torch_model = getattr(inner, "model", None)  # flyscale/tracking/model_code.py's
        if self.served is not None:
            self.output = str(self.served.serving["output"])
        elif isinstance(self.torch_model, nn.Module):
            self.output = "raw"
        else:
            raise ValueError(f"it is not a flyscale model ({type(inner).__name__})")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.output == "raw":
            assert self.torch_model is not None
            self.torch_model.eval()
            return self.torch_model(x)
        if self.output == "text":
            served = self.served
            assert served is not None  # a text output is only ever read from the served model
            ids = x.numpy().astype(served.dtype, copy=False)
            return torch.from_numpy(np.asarray(served.run(ids), dtype=np.float32))
        if len(x) == 0 and self.served is not None:  # the served model refuses an empty batch, rightly
            raw = torch.from_numpy(np.asarray(self.served.run(x.numpy().astype(self.served.dtype)), dtype=np.float32))
            if self.output == "probabilities":
                return raw.log_softmax(-1)
            return raw.reshape(0) if self.served.serving.get("scalar") and raw.ndim == 2 else raw
        # A request at a time: the served model refuses more rows than its serving.max_rows.
        most = max(1, int(getattr(self.served, "limits", {}).get("max_rows", len(x))))
        answer = np.concatenate(
            [np.asarray(self.pyfunc.predict(x[i : i + most].numpy()), dtype=np.float32) for i in range(0, len(x), most)]
        )
        if self.output == "probabilities":
            return torch.log(torch.from_numpy(answer).clamp_min(1e-30))
        return torch.from_numpy(answer)


# Not a model's quality: its file and its speed, which this scoring (another runtime, beside other
# work) does not measure the way the candidate's were.
NOT_SCORED = ("size_bytes", "*_per_s", "latency_*", "throughput*")


def scores(module: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], goal: Any, context) -> dict:
    """The objective's metrics of `module` over the batches: what the gates compare, the
    objective's own first, without size and speed (NOT_SCORED)."""
    evaluator = goal.evaluator(context)
    pair = getattr(goal, "pair", None)
    with torch.no_grad():
        for xb, yb in batches:
            if pair is not None:
                xb, yb = pair(xb, yb)
            evaluator.update(module(xb), yb)
    measured = evaluator.result().scalars()
    first = [k for k in getattr(goal, "metrics", {}) if k in measured]
    kept = [k for k in dict.fromkeys([*first, *measured]) if not any(fnmatch.fnmatchcase(k, p) for p in NOT_SCORED)]
    return {k: float(measured[k]) for k in kept}


def score(
    cfg: MlflowConfig,
    champion: ChampionRef,
    candidate: kinds.ModelKind,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    goal: Any,
    context: ObjectiveContext,
) -> ChampionRef:
    """`champion` with its metrics on the candidate's test split (`batches`, as the candidate's
    evaluation read them), or with why it cannot be scored there; unchanged when there is none."""
    if not champion.version:
        return champion
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    with client_settings(cfg), mlflow_errors(f"scoring {champion.model_name} {champion.label()} on this test split"):
        client = MlflowClient(tracking_uri())
        version = client.get_model_version(champion.model_name, champion.version)
        registered = kinds.version_kind(client, champion.model_name, version)
        if registered is None:
            return _unscored(champion, "it is not a flyscale model (it records no kind, and carries no flyscale spec)")
        if not registered.same(candidate):
            if cfg.replace_kind:
                return dataclasses.replace(champion, other_kind=str(registered))
            return _unscored(
                champion,
                f"it takes {registered}, this run's model {candidate} ({'; '.join(registered.differences(candidate))})",
            )
        with tempfile.TemporaryDirectory(prefix="flyscale-champion-") as tmp:
            try:
                pyfunc = _load(champion, tmp)
            except MlflowException as exc:
                if exc.error_code not in NOT_THERE:
                    raise
                return _unscored(champion, f"its registered model does not load ({_first_line(exc)})")
            except Exception as exc:  # noqa: BLE001 (any reason it cannot load is the reason it is not scored)
                return _unscored(
                    champion, f"its registered model does not load ({type(exc).__name__}: {_first_line(exc)})"
                )
            if candidate.text and _tokenizer(tmp) != context.tokenizer_json:
                return _unscored(
                    champion, "its tokenizer is not this run's, so this split's token ids are other text to it"
                )
            try:
                measured = scores(RegisteredModule(pyfunc), batches, goal, context)
            except Exception as exc:  # noqa: BLE001 (the served model refusing this split is the reason)
                return _unscored(champion, f"its registered model did not answer this split ({_first_line(exc)})")
    log.info("champion %s scored on this run's test split: %s", champion.label(), measured)
    return dataclasses.replace(champion, scored=measured)


def _load(champion: ChampionRef, into: str) -> Any:
    """The registered model as serving loads it (pyfunc, from the registry), its files under `into`."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    return mlflow.pyfunc.load_model(f"models:/{champion.model_name}/{champion.version}", dst_path=into)


def _tokenizer(model_dir: str) -> str:
    """The tokenizer JSON a downloaded language model carries ("" for none)."""
    from flyscale.tracking.model_spec import artifact_files

    path = artifact_files(Path(model_dir)).get("tokenizer")
    return path.read_text() if path is not None and path.is_file() else ""


def _unscored(champion: ChampionRef, why: str) -> ChampionRef:
    log.warning("champion %s is not scored on this run's test split: %s", champion.label(), why)
    return dataclasses.replace(champion, unscored=why)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
