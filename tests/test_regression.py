"""Regression: the objective's loss and its streamed metrics against scikit-learn's at any batching
and for every shape a target comes in; scikit-learn's diabetes data through flyscale's own
preparation (a float target checked as a number, not a class, and profiled and drifted as a
feature); the residual plot in place of a classifier's figures; then the preset through real
`pyflyte run`, its R² gate and the served model's predictions in the target's units."""

from __future__ import annotations

import math
import re

import numpy as np
import pyarrow as pa
import pytest
import torch
from sklearn.metrics import mean_absolute_error, r2_score, root_mean_squared_error

from flyscale.api import ObjectiveContext
from flyscale.config import DataConfig
from flyscale.data import example_combine, example_prep, fields, shards, source
from flyscale.data.reference import Reference
from flyscale.errors import DataError
from flyscale.evaluate.comparison import Comparison
from flyscale.evaluate.latency import LatencyReport
from flyscale.evaluate.metrics import PLOTTED, EvalMetrics, evaluate_batches
from flyscale.plugin import registry
from flyscale.render import plots
from flyscale.train.telemetry import EpochMetrics, TrainHistory
from flyscale_plugins.regression import Regression, RegressionOptions
from flyscale_plugins.sklearn_data import Diabetes
from tests.conftest import REPO, run_pipeline

CFG = DataConfig(dataset="diabetes")
INFO = Diabetes().info(None)


def _evaluated(objective, predicted: torch.Tensor, targets: torch.Tensor, batch: int) -> EvalMetrics:
    """The objective's evaluator over (predicted, targets) in batches of `batch` rows."""
    evaluator = objective.evaluator(ObjectiveContext(INFO))
    for i in range(0, len(targets), batch):
        evaluator.update(predicted[i : i + batch], targets[i : i + batch])
    return evaluator.result()


# --- the objective -------------------------------------------------------------------------------


def test_the_objective_is_found_by_name_with_its_options():
    plugin = registry.objectives.get("regression")
    assert plugin.metrics == {"mae": False, "rmse": False, "r2": True} and plugin.headline == "r2"
    assert plugin.with_options(RegressionOptions(loss="mae")).options.loss == "mae"
    with pytest.raises(ValueError, match="loss must be one of mse, mae, got 'huber'"):
        RegressionOptions(loss="huber")


@pytest.mark.parametrize("shape", ["(N,)", "(N,1)", "(N,3)"])
def test_the_loss_is_the_mean_squared_or_absolute_error_and_scores_add_up_to_it(shape):
    g = torch.Generator().manual_seed(0)
    k = 3 if shape == "(N,3)" else 1
    out = torch.randn(50, k, generator=g) * 40 + 150
    y = torch.randn(50, k, generator=g) * 40 + 150
    if shape == "(N,)":
        y = y[:, 0]  # a scalar target against the model's (N, 1)
    for name, expected in (
        ("mse", ((out - y.reshape(50, k)) ** 2).mean()),
        ("mae", (out - y.reshape(50, k)).abs().mean()),
    ):
        objective = Regression(RegressionOptions(loss=name))
        assert torch.allclose(objective.loss(out, y), expected)
        summed, hits, count = objective.score(out, y)
        assert count == 50 * k and int(hits) == 0 and hits.dtype == torch.long
        assert torch.allclose(summed / count, expected)
    # The model's (N,) output against a scalar target is the same as (N, 1).
    if k == 1:
        assert torch.equal(Regression().loss(out[:, 0], y), Regression().loss(out, y))


def test_the_loss_is_computed_in_float32_whatever_the_model_computes_in():
    out, y = torch.full((4, 1), 300.0, dtype=torch.float16), torch.zeros(4)
    assert Regression().loss(out, y).dtype == torch.float32
    assert math.isclose(float(Regression().loss(out, y)), 90_000.0)  # over float16's 65,504


def test_outputs_that_do_not_fit_the_targets_are_refused_naming_both_shapes():
    with pytest.raises(ValueError, match=r"outputs \(8, 10\) do not fit the targets \(8,\).*num_classes"):
        Regression().loss(torch.zeros(8, 10), torch.zeros(8))
    with pytest.raises(ValueError, match=r"outputs \(8, 1\) do not fit the targets \(8, 2\)"):
        Regression().score(torch.zeros(8, 1), torch.zeros(8, 2))


@pytest.mark.parametrize("batch", [1, 7, 64, 500])
@pytest.mark.parametrize("k", [1, 3])
def test_streamed_metrics_equal_scikit_learns_at_any_batching(batch, k):
    rng = np.random.default_rng(k)
    y = rng.normal(150, 70, (500, k)) + rng.normal(0, 5, (1, k)) * np.arange(k)  # targets of different scales
    p = y * 0.6 + rng.normal(0, 40, (500, k)) + 20
    targets = torch.tensor(y[:, 0] if k == 1 else y, dtype=torch.float64)  # a scalar target as (N,)
    got = _evaluated(Regression(), torch.tensor(p), targets, batch)
    assert got.objective == "regression" and got.n == 500
    assert math.isclose(got.values["mae"], mean_absolute_error(y, p), rel_tol=1e-9)
    assert math.isclose(got.values["rmse"], root_mean_squared_error(y, p), rel_tol=1e-9)
    assert math.isclose(got.values["r2"], r2_score(y, p), rel_tol=1e-9)
    assert math.isclose(got.loss, float(np.mean((y - p) ** 2)), rel_tol=1e-9)
    mae = _evaluated(Regression(RegressionOptions(loss="mae")), torch.tensor(p), targets, batch)
    assert math.isclose(mae.loss, mean_absolute_error(y, p), rel_tol=1e-9)
    # The gates and MLflow read them by name; the classifier's fields are not reported.
    assert set(got.scalars()) == {"loss", "size_bytes", "mae", "rmse", "r2"}


def test_r2_of_a_constant_target_is_as_scikit_learn_says():
    y = torch.full((10,), 3.0)
    assert _evaluated(Regression(), y[:, None].clone(), y, 4).values["r2"] == r2_score(y, y) == 1.0
    assert _evaluated(Regression(), y[:, None] + 1, y, 4).values["r2"] == r2_score(y, y + 1) == 0.0


def test_the_residual_sample_is_bounded_uniform_and_the_same_however_the_split_is_batched():
    n = PLOTTED * 3
    y = torch.arange(n, dtype=torch.float32)
    p = (y * 2)[:, None]
    samples = [_evaluated(Regression(), p, y, batch) for batch in (n, 1000, 333)]
    first = samples[0]
    assert len(first.predicted) == len(first.actual) == PLOTTED
    assert all(s.predicted == first.predicted and s.actual == first.actual for s in samples[1:])
    assert all(pr == 2 * a for pr, a in zip(first.predicted, first.actual))  # real pairs, kept together
    assert np.mean(first.actual) == pytest.approx(n / 2, rel=0.05)  # from the whole split, not its start
    few = _evaluated(Regression(), p[:50], y[:50], 16)
    assert few.actual == y[:50].tolist()  # fewer than PLOTTED: every pair, in order


def test_evaluate_batches_scores_a_model_with_the_objective():
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    x, y = torch.randn(100, 10), torch.randn(100) * 50 + 150
    got = evaluate_batches(model, [(x[:60], y[:60]), (x[60:], y[60:])], Regression(), ObjectiveContext(INFO))
    with torch.no_grad():
        p = model(x)[:, 0].numpy()
    assert math.isclose(got.values["r2"], r2_score(y.numpy(), p), rel_tol=1e-5)
    assert got.size_bytes > 0 and got.scalars()["r2"] == got.values["r2"]


def test_the_served_model_returns_predictions_in_the_targets_units_one_per_example():
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    with torch.no_grad():
        model.bias.fill_(152.0)  # the diabetes target's mean
    x = np.random.default_rng(0).normal(0, 0.05, (5, 10)).astype("float32")
    got = Regression().predict(model, x, {}, ObjectiveContext(INFO))
    assert got.shape == (5,)  # a scalar target: one value per example, not (5, 1)
    np.testing.assert_allclose(got, model(torch.from_numpy(x)).detach().numpy()[:, 0], rtol=1e-6)
    two = Diabetes().info(None)
    two.fields[1].shape = [2]  # two targets per example: (N, 2) as the model gives them
    assert Regression().predict(torch.nn.Linear(10, 2), x, {}, ObjectiveContext(two)).shape == (5, 2)
    with pytest.raises(ValueError, match=r"unknown params \['temperature'\]: a regression model takes none"):
        Regression().predict(model, x, {"temperature": 1.0}, ObjectiveContext(INFO))


# --- the diabetes data through flyscale's preparation --------------------------------------------


@pytest.fixture(scope="module")
def diabetes():
    info = source.info(CFG)
    part = example_prep.prepare_shard(source.examples(CFG, ""), CFG, info)
    return example_combine.combine([part], CFG, info, Reference())


def test_diabetes_is_prepared_as_typed_examples_with_a_float_target(diabetes):
    from sklearn.datasets import load_diabetes

    x_all, y_all = load_diabetes(return_X_y=True)
    assert diabetes.report.total_rows == diabetes.report.valid_rows == 442
    assert diabetes.train.rows + diabetes.val.rows + diabetes.test.rows == 442
    reader = fields.reader(diabetes.info)
    assert reader.label_dtype == "float32"
    table = shards.read_table(diabetes.test.dir.path, [*reader.columns, "source_row"])
    x, y = reader.read(table)
    rows = table.column("source_row").to_numpy()
    assert x.shape == (diabetes.test.rows, 10) and x.dtype == np.float32 and y.dtype == np.float32
    np.testing.assert_allclose(y, y_all[rows], rtol=1e-6)  # the target in its own units
    np.testing.assert_allclose(x, x_all[rows], rtol=1e-6)


def test_a_float_target_is_profiled_as_a_feature_and_drifts_by_psi(diabetes):
    profile = diabetes.profile
    assert sorted(profile.features) == ["features[values]", "target[values]"]
    assert profile.labels == {}  # no counts per class: there are no classes
    assert sum(profile.features["target[values]"].counts) == 442
    # Against itself nothing moves; a batch whose targets are a third higher drifts on the target.
    info = diabetes.info
    same = example_combine.combine(
        [example_prep.prepare_shard(source.examples(CFG, ""), CFG, info)], CFG, info, Reference("v1", profile=profile)
    )
    assert max(same.report.drift.values()) < 1e-9 and "label" not in same.report.drift
    batch = next(iter(source.examples(CFG, "")))
    higher = batch.set_column(1, "target", pa.array(batch.column("target").to_numpy() * 1.35))
    strict = DataConfig(dataset="diabetes", max_drift_psi=0.25)
    with pytest.raises(DataError, match=r"max_drift_psi=0.25 for 1 of 2 columns \(target\[values\]"):
        example_combine.combine(
            [example_prep.prepare_shard([higher], strict, info)], strict, info, Reference("v1", profile=profile)
        )


def test_a_target_that_is_not_finite_is_quarantined_naming_it_and_any_real_value_is_kept():
    batch = next(iter(source.examples(CFG, "")))
    target = batch.column("target").to_numpy().copy()
    target[[3, 4]] = [np.nan, np.inf]
    target[5] = 1e6  # far beyond any class number: a real target is not held to 0..num_classes-1
    target[6] = -2.5
    cfg = DataConfig(dataset="diabetes", max_quarantine_fraction=0.5)
    info = source.info(cfg)
    prepared = example_combine.combine(
        [example_prep.prepare_shard([batch.set_column(1, "target", pa.array(target))], cfg, info)],
        cfg,
        info,
        Reference(),
    )
    quarantined = shards.read_table(prepared.quarantined.dir.path, ["source_row", "reason"]).to_pylist()
    assert {q["source_row"]: q["reason"] for q in quarantined} == {
        3: "target: finite (got NaN or inf)",
        4: "target: finite (got NaN or inf)",
    }
    assert prepared.report.checks == {"target: finite": 2}
    kept = np.concatenate(
        [
            shards.read_table(s.dir.path, ["target"]).column("target").to_numpy()
            for s in (prepared.train, prepared.val, prepared.test)
        ]
    )
    assert 1e6 in kept and -2.5 in kept and len(kept) == 440


# --- the run's figures ----------------------------------------------------------------------------


def _run(objective: str, **metrics) -> tuple[EvalMetrics, Comparison, TrainHistory]:
    m = EvalMetrics(0.0, 0.0, 1.0, 100, [], 0, objective=objective, **metrics)
    latency = LatencyReport(model="fp32", batch_sizes=[1, 8], p50_ms=[0.1, 0.2], p99_ms=[0.2, 0.3])
    history = TrainHistory(strategy="ddp", world_size=2)
    history.epochs = [EpochMetrics(e, 3000.0 / (e + 1), None, 2900.0 / (e + 1), 0.0, 0.1, 1e4) for e in range(3)]
    return m, Comparison(quantizer="dynamic_int8", fp32_latency=latency, int8_latency=latency), history


def test_a_regressors_run_draws_its_residuals_and_no_classifier_figures(tmp_path):
    rng = np.random.default_rng(0)
    actual = rng.uniform(25, 346, 100)
    fp32, comparison, history = _run(
        "regression", values={"r2": 0.5}, predicted=(actual + rng.normal(0, 50, 100)).tolist(), actual=actual.tolist()
    )
    plots.draw_run(str(tmp_path), fp32, fp32, comparison, history)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(plots.run_plots("regression"))
    assert plots.RESIDUALS in plots.run_plots("regression") and plots.CONFUSION_FP32 not in plots.run_plots(
        "regression"
    )
    drawn = (tmp_path / plots.RESIDUALS).read_bytes()
    assert drawn[:8] == b"\x89PNG\r\n\x1a\n"
    # Two panels of points, not the empty figure of a run that kept no pairs.
    fig = plots.residual_plot(fp32, "t", str(tmp_path / "again.png"))
    assert [len(ax.collections[0].get_offsets()) for ax in fig.axes] == [100, 100]
    empty = plots.residual_plot(_run("regression")[0], "t", str(tmp_path / "empty.png"))
    assert not empty.axes and len(drawn) > 2 * (tmp_path / "empty.png").stat().st_size
    # The loss alone: a regressor counts no hits, so there is no accuracy panel of zeros.
    assert len(plots.learning_curves(history, str(tmp_path / "curves.png"), accuracy=False).axes) == 1


def test_a_language_models_run_draws_only_its_learning_curves_and_latency(tmp_path):
    fp32, comparison, history = _run("language_modeling", values={"perplexity": 4.0})
    for m in history.epochs:
        m.val_accuracy = 0.4  # next-token accuracy: its panel stays
    plots.draw_run(str(tmp_path), fp32, fp32, comparison, history)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([plots.LEARNING_CURVES, plots.LATENCY])


# --- the preset, end to end ------------------------------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_the_diabetes_preset_passes_its_r2_gate_and_serves_predictions_in_the_targets_units(tmp_path, mlflow_server):
    import mlflow

    preset = str(REPO / "configs/diabetes-regression.yaml")
    small = '{"mlflow": {"model_name": "diabetes-e2e"}}'
    # As documented: FLYSCALE_NPROC_PER_NODE unset, so auto times one process against 2 workers.
    env = {"MLFLOW_TRACKING_URI": mlflow_server, "FLYSCALE_NPROC_PER_NODE": ""}
    proc = run_pipeline(tmp_path, "--cfg", preset, "--cfg", small, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert re.search(r"^  workers     (1 of 2|2) \(auto: in the preflight .* samples/s", out, re.M), out[-2500:]
    assert "communication-bound" not in out + proc.stderr  # the count was measured, not assumed
    assert "442 rows: 442 valid, 0 quarantined" in out
    assert "min_metric: PASSED (test r2" in out, out[-2500:]
    # The int8 twin is judged on accuracy where it pays (smaller and faster, as timed), else not registered.
    if "  int8        pays: " in out:
        assert "quantization: PASSED (r2 drop" in out and "registered  diabetes-e2e v1, diabetes-e2e-int8 v1" in out
    else:
        assert "quantization: PASSED (int8 is not registered" in out, out[-2500:]
        assert "registered  diabetes-e2e v1 (no int8 twin)" in out
    mlflow.set_tracking_uri(mlflow_server)
    model = mlflow.pyfunc.load_model("models:/diabetes-e2e@champion")
    # An average patient (sklearn's features are centred: zeros), in the target's units (25..346).
    predicted = np.asarray(model.predict(np.zeros((2, 10), dtype="float32")))
    assert predicted.shape == (2,) and np.all((predicted > 80) & (predicted < 250)), predicted
