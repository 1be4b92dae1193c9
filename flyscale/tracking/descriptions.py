"""What the registry page says to a person: a description of each registered version (what it is,
its headline metrics, the champion it was judged against and by how much it differs, its data,
and how to load and serve it) and of the registered model (the pipeline that feeds it).

The tags stay, for machines; these are Markdown, which MLflow's UI renders.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyscale.config import PipelineConfig
from flyscale.tracking.run_log import RunRecord

HEADLINE = ("accuracy", "macro_f1", "loss", "perplexity", "bits_per_byte", "mse", "mae", "r2")


def headline(metrics: dict[str, float]) -> list[str]:
    """The metrics a person reads first, in that order, of those the model has."""
    return [k for k in HEADLINE if k in metrics]


def version_description(record: RunRecord, cfg: PipelineConfig, model_name: str, version: str, int8: bool) -> str:
    """The Markdown description of `model_name` version `version`."""
    ours = (record.int8 if int8 else record.fp32).scalars()
    champion = record.judged_against
    h = record.history
    kind = f"the int8 twin ({cfg.quantize.name}) of " if int8 else ""
    lines = [
        f"**{model_name} v{version}**: {kind}a `{cfg.model.name}` model with the `{cfg.objective.name}` objective, "
        f"trained with `{h.strategy}` on {h.world_size} worker(s) for {len(h.epochs)} epochs on dataset "
        f"`{cfg.data.dataset}` (data fingerprint `{record.data_sha256[:16]}`).",
        "",
        # The champion's numbers on this version's test split where it was scored there.
        f"| test metric | v{version} | {champion.label()}{' (on this test split)' if champion.scored else ''} |",
        "|---|---|---|",
    ]
    for k in headline(ours):
        theirs = (champion.scored or champion.metrics).get(k)
        beside = f"{theirs:.4f} ({ours[k] - theirs:+.4f})" if theirs is not None else "-"
        lines.append(f"| {k.replace('_', ' ')} | {ours[k]:.4f} | {beside} |")
    lines += [
        "",
        "Gates: "
        + "; ".join(f"{v.name} {'passed' if v.passed else 'FAILED'} ({v.reason})" for v in record.verdicts)
        + ".",
    ]
    if record.onnx_path and not int8:
        lines += ["", f"ONNX: artifact `onnx/model.onnx` of the run; {record.onnx_parity}."]
    elif record.onnx_parity and not int8:
        lines += ["", f"ONNX: {record.onnx_parity}."]
    uri = f"models:/{model_name}/{version}"
    served_alone = serves_alone(cfg, record, int8)
    lines += [
        "",
        (
            "Load it (it needs only mlflow, onnxruntime and numpy: it is served from its ONNX file; the PyTorch "
            "weights are its `weights` artifact, for fine-tuning):"
            if served_alone
            else "Load it (flyscale and its model plugin installed):"
        ),
        "",
        "```python",
        "import mlflow",
        f'model = mlflow.pyfunc.load_model("{uri}")',
        "```",
        "",
        "Serve it on http://127.0.0.1:5001/invocations"
        + (" (uv builds an environment of its requirements only):" if served_alone else ":"),
        "",
        "```bash",
        f'mlflow models serve -m "{uri}" --env-manager {"uv" if served_alone else "local"} -p 5001',
        "```",
    ]
    return "\n".join(lines)


def serves_alone(cfg: PipelineConfig, record: RunRecord, int8: bool) -> bool:
    """Whether this registered model is the ONNX one that loads without flyscale (as
    model_log.model_args decides it)."""
    from flyscale.evaluate.quantize import works_on_onnx
    from flyscale.export.onnx import serves_alone as objective_serves_alone
    from flyscale.train.objective import of

    exported = works_on_onnx(cfg.quantize) if int8 else bool(record.onnx_path)
    return exported and objective_serves_alone(of(cfg.objective))


def model_description(cfg: PipelineConfig, model_name: str, int8: bool) -> str:
    """The Markdown description of the registered model `model_name`: what feeds it."""
    gates = ", ".join(f"`{g.name}`" for g in cfg.gate.gates) or "none"
    twin = (
        f"The int8 twin of `{model_name.removesuffix('-int8')}`, quantized with `{cfg.quantize.name}`, registered "
        f"beside each of its versions."
        if int8
        else f"Its int8 twin is `{model_name}-int8`."
    )
    return "\n".join(
        [
            f"Trained by flyscale's `training_pipeline` (`workflows/train.py`): dataset `{cfg.data.dataset}` is "
            f"validated (bad rows quarantined with their reasons), split, and fed to a `{cfg.model.name}` model "
            f"with the `{cfg.objective.name}` objective; the trained model is evaluated on the test split, exported "
            f"to ONNX and checked against PyTorch, quantized, and judged by the gates ({gates}).",
            "",
            "A version is registered only when every gate passes; "
            + (
                f"it then becomes `{cfg.mlflow.challenger_alias}` for a person to promote (`flyscale promote`). "
                if cfg.mlflow.promotion == "manual"
                else f"the `{cfg.mlflow.alias}` alias moves to it by compare-and-set, only if the champion is still "
                f"the one it was judged against. "
            )
            + twin,
            "",
            "Each version's description gives its metrics beside the champion's and how to load and serve it; its "
            "tags (`flyscale.*`) hold the lineage: data fingerprint, config, commit, image, Flyte execution.",
        ]
    )


@dataclass
class Describer:
    """The descriptions of one run's registrations, for the publish step to write."""

    record: RunRecord
    cfg: PipelineConfig

    def version(self, model_name: str, version: str) -> str:
        return version_description(self.record, self.cfg, model_name, version, int8=self._int8(model_name))

    def model(self, model_name: str) -> str:
        return model_description(self.cfg, model_name, int8=self._int8(model_name))

    def _int8(self, model_name: str) -> bool:
        return model_name == f"{self.cfg.mlflow.model_name}-int8"
