"""Calibration, per-class precision/recall, metric directions, inference latency and the plots:
each against numbers worked out by hand or by an independent implementation."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from sklearn.metrics import (
    accuracy_score,
    confusion_matrix,
    f1_score,
    precision_score,
    recall_score,
)
from torch import nn

from flyscale.evaluate import latency
from flyscale.evaluate.latency import LatencyReport, measure, measure_side_by_side
from flyscale.evaluate.metrics import (
    CALIBRATION_BINS,
    EvalMetrics,
    evaluate_batches,
    higher_is_better,
    reliability,
)
from flyscale.plugin import registry
from flyscale.plugin.contracts import DatasetInfo, ObjectiveContext
from flyscale.render import plots
from flyscale.train.telemetry import EpochMetrics, TrainHistory
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

EDGES = np.linspace(0.0, 1.0, CALIBRATION_BINS + 1)


def two_class_logits(confidence: float, predicted: int, classes: int = 2) -> list[float]:
    """Logits whose softmax gives `confidence` to class `predicted` (of two unless told)."""
    p = [(1.0 - confidence) / (classes - 1)] * classes
    p[predicted] = confidence
    return [math.log(v) for v in p]


def classify(model: nn.Module, batches, num_classes: int) -> EvalMetrics:
    """evaluate_batches through the classification objective, as the evaluate task calls it."""
    info = DatasetInfo("t", num_classes, [1], [])
    return evaluate_batches(model, batches, registry.objectives.get("classification"), ObjectiveContext(info))


def evaluate_logits(rows: list[tuple[list[float], int]], num_classes: int = 2, batch: int = 3) -> EvalMetrics:
    """evaluate_batches on a model that returns its input: the logits are the test rows, streamed."""
    x = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    y = torch.tensor([r[1] for r in rows], dtype=torch.long)
    batches = ((x[i : i + batch], y[i : i + batch]) for i in range(0, len(y), batch))
    return classify(nn.Identity(), batches, num_classes)


def brute_force_ece(confidence: np.ndarray, correct: np.ndarray, bins: int) -> float:
    """The textbook sum over bins (lo, hi], written out a bin at a time."""
    total = 0.0
    for k in range(bins):
        lo, hi = k / bins, (k + 1) / bins
        inside = (confidence > lo) & (confidence <= hi) if k else (confidence <= hi)
        if inside.any():
            total += inside.sum() / len(confidence) * abs(correct[inside].mean() - confidence[inside].mean())
    return float(total)


# --- calibration -----------------------------------------------------------------------------


def test_ece_of_a_hand_worked_example():
    # 4 rows at confidence 0.95 (bin 14), half right: |0.5 - 0.95| = 0.45, weight 0.4.
    # 6 rows at confidence 0.70 (bin 10), all right:   |1.0 - 0.70| = 0.30, weight 0.6.
    rows = [(two_class_logits(0.95, 0), t) for t in (0, 0, 1, 1)] + [(two_class_logits(0.7, 1), 1)] * 6
    m = evaluate_logits(rows)
    assert m.ece == pytest.approx(0.4 * 0.45 + 0.6 * 0.30, abs=1e-6)
    assert len(m.reliability_count) == CALIBRATION_BINS
    assert m.reliability_count == [0] * 10 + [6, 0, 0, 0, 4]
    assert m.reliability_confidence[14] == pytest.approx(0.95, abs=1e-6)
    assert m.reliability_confidence[10] == pytest.approx(0.70, abs=1e-6)
    assert m.reliability_accuracy[14] == 0.5 and m.reliability_accuracy[10] == 1.0
    assert m.accuracy == 0.8 and m.n == 10


def test_a_perfectly_calibrated_model_has_zero_ece():
    # 0.9 confident and right 9 times in 10; 0.75 confident and right 3 times in 4.
    rows = [(two_class_logits(0.9, 1), 1)] * 9 + [(two_class_logits(0.9, 1), 0)]
    rows += [(two_class_logits(0.75, 0), 0)] * 3 + [(two_class_logits(0.75, 0), 1)]
    m = evaluate_logits(rows)
    assert m.ece == pytest.approx(0.0, abs=1e-6)
    assert sum(m.reliability_count) == 14


def test_a_badly_over_confident_model_has_a_large_ece():
    # 99% sure every time, right half the time: ECE is the whole gap, 0.49.
    rows = [(two_class_logits(0.99, 0), t) for t in (0, 1) * 10]
    m = evaluate_logits(rows)
    assert m.ece == pytest.approx(0.49, abs=1e-6)
    assert m.reliability_count[-1] == 20


def test_bins_close_on_the_right():
    """A confidence on an inner edge belongs to the bin that edge closes; 1.0 to the last bin."""
    confidence = np.array([EDGES[9], np.nextafter(EDGES[9], 1.0), 1.0, EDGES[1] / 2, EDGES[1]])
    ece, _, _, count = reliability(confidence, np.array([1, 0, 1, 1, 0]))
    assert count[8] == 1 and count[9] == 1 and count[14] == 1 and count[0] == 2
    assert sum(count) == 5


def test_ece_matches_the_textbook_sum_on_random_data():
    rng = np.random.default_rng(0)
    confidence = np.concatenate([rng.uniform(0.1, 1.0, 500), EDGES[1:], [1.0] * 5])  # edges included
    correct = rng.random(len(confidence)) < confidence**2
    ece, conf, acc, count = reliability(confidence, correct)
    assert ece == pytest.approx(brute_force_ece(confidence, correct, CALIBRATION_BINS), abs=1e-12)
    assert sum(count) == len(confidence)
    # The diagram's bars are the per-bin means that the ECE weighs.
    assert sum(c * abs(a - f) for c, a, f in zip(count, acc, conf)) / len(confidence) == pytest.approx(ece)


# --- precision and recall ----------------------------------------------------------------------


def test_per_class_metrics_accuracy_f1_and_confusion_match_sklearn():
    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    with torch.no_grad():
        model.bias[4] = -100.0  # class 4 is never predicted: its precision is 0, not NaN
    x = torch.randn(203, 6)
    y = torch.randint(0, 4, (203,))  # class 4 never occurs: its recall is 0, not NaN
    batches = ((x[i : i + 50], y[i : i + 50]) for i in range(0, len(y), 50))
    m = classify(model, batches, 5)
    pred = model(x).argmax(1).numpy()
    labels = list(range(5))
    assert m.precision == pytest.approx(precision_score(y, pred, labels=labels, average=None, zero_division=0).tolist())
    assert m.recall == pytest.approx(recall_score(y, pred, labels=labels, average=None, zero_division=0).tolist())
    assert m.precision[4] == 0.0 and m.recall[4] == 0.0
    assert len(set(m.precision)) > 2 and m.precision != m.recall  # a real comparison, not all zeros
    # Our own confusion matrix, accuracy and macro-F1 (scikit-learn's import is not paid per run).
    assert m.confusion == confusion_matrix(y, pred, labels=labels).tolist()
    assert m.accuracy == pytest.approx(accuracy_score(y, pred))
    assert m.macro_f1 == pytest.approx(f1_score(y, pred, labels=labels, average="macro", zero_division=0))
    assert 0.1 < m.macro_f1 < m.accuracy < 0.9  # neither trivial: class 4 counts as an F1 of 0 in the mean


# --- names and directions ------------------------------------------------------------------------


def test_scalars_keep_their_names_and_add_the_new_ones():
    rows = [(two_class_logits(0.8, 0, 3), 0), (two_class_logits(0.6, 1, 3), 0), (two_class_logits(0.7, 2, 3), 2)]
    m = evaluate_logits(rows, 3)
    assert set(m.scalars("test_")) == {
        "test_accuracy",
        "test_macro_f1",
        "test_loss",
        "test_size_bytes",
        "test_ece",
        "test_precision_class_0",
        "test_precision_class_1",
        "test_precision_class_2",
        "test_recall_class_0",
        "test_recall_class_1",
        "test_recall_class_2",
    }
    assert m.scalars()["ece"] == m.ece and m.scalars()["recall_class_0"] == 0.5
    assert all(isinstance(v, float) for v in m.scalars().values())


def test_metrics_from_before_calibration_claim_no_ece():
    old = EvalMetrics(accuracy=0.9, macro_f1=0.9, loss=0.3, n=10, confusion=[[5, 0], [1, 4]], size_bytes=100)
    assert set(old.scalars()) == {"accuracy", "macro_f1", "loss", "size_bytes"}


def test_a_cached_literal_from_before_the_new_fields_still_loads():
    """What a Flyte cache holds from an older flyscale: the old fields only."""
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    old_fields = [(f.name, f.type, f) for f in dataclasses.fields(EvalMetrics)][:7]
    Old = dataclasses.make_dataclass("EvalMetrics", old_fields)
    ctx = FlyteContextManager.current_context()
    before = Old(
        accuracy=0.9, macro_f1=0.8, loss=0.3, n=2, confusion=[[1, 0], [0, 1]], size_bytes=5, weights_sha256="ab"
    )
    literal = TypeEngine.to_literal(ctx, before, Old, TypeEngine.to_literal_type(Old))
    loaded = TypeEngine.to_python_value(ctx, literal, EvalMetrics)
    assert loaded == EvalMetrics(**dataclasses.asdict(before))
    assert loaded.precision == [] and loaded.reliability_count == []
    # And the new fields make the round trip themselves.
    new = evaluate_logits([(two_class_logits(0.9, 0), 0), (two_class_logits(0.7, 1), 0)])
    lit = TypeEngine.to_literal(ctx, new, EvalMetrics, TypeEngine.to_literal_type(EvalMetrics))
    assert TypeEngine.to_python_value(ctx, lit, EvalMetrics) == new


@pytest.mark.parametrize(
    "name",
    [
        "loss",
        "test_loss",
        "val_loss",
        "train_loss",
        "ece",
        "int8_test_ece",
        "size_bytes",
        "test_size_bytes",
        "latency_p50_ms_b64",
        "int8_test_latency_p99_ms_b1",
        "int8_accuracy_drop",
        "throughput_drop",
        "error",
        "test_perplexity",
        "int8_perplexity_increase",
        "bits_per_byte",
        "int8_test_bits_per_token",
        "mae",
        "test_rmse",
        "r2_drop",
    ],
)
def test_lower_is_better(name):
    assert higher_is_better(name) is False


@pytest.mark.parametrize(
    "name",
    [
        "accuracy",
        "int8_test_accuracy",
        "val_accuracy",
        "macro_f1",
        "test_macro_f1",
        "precision_class_3",
        "test_recall_class_0",
        "throughput_b256",
        "int8_throughput_b1",
        "speedup_b64",
        "size_ratio",
        "test_r2",
        "token_accuracy",
        "tokens_per_s",
        "samples_per_s",
    ],
)
def test_higher_is_better(name):
    assert higher_is_better(name) is True


@pytest.mark.parametrize("name", ["epoch_seconds", "accuracyish", "f1", "tokens", ""])
def test_an_unknown_metric_has_no_direction(name):
    with pytest.raises(ValueError) as err:
        higher_is_better(name)
    assert repr(name) in str(err.value) and "latency_*" in str(err.value) and "accuracy" in str(err.value)


def test_every_scalar_flyscale_records_here_has_a_direction():
    m = evaluate_logits([(two_class_logits(0.9, 0), 0), (two_class_logits(0.7, 1), 0)])
    report = LatencyReport(batch_sizes=[1, 64], p50_ms=[0.1, 0.4], p99_ms=[0.2, 0.9], throughput=[1e4, 1.6e5])
    for key in [*m.scalars("int8_test_"), *report.scalars("test_")]:
        higher_is_better(key)  # raises for a name without one


# --- latency --------------------------------------------------------------------------------------


class Recorder(nn.Module):
    """A small real model that notes how it is called."""

    def __init__(self, name: str, log: list):
        super().__init__()
        self.name, self.log, self.linear = name, log, nn.Linear(32, 4)

    def forward(self, x):
        self.log.append((self.name, self.training, torch.is_inference_mode_enabled(), x.dtype, tuple(x.shape)))
        return self.linear(x)


def test_measure_a_small_linear_model():
    model = nn.Linear(64, 10)
    sizes = (1, 8, 64)
    report = measure(model, 64, sizes, budget_s=0.3)
    assert report.batch_sizes == list(sizes)
    r = report
    for b, p50, p99, tput, n in zip(r.batch_sizes, r.p50_ms, r.p99_ms, r.throughput, r.repeats):
        assert p99 >= p50 > 0
        assert tput == pytest.approx(b / (p50 / 1000.0))
        assert latency.MIN_REPEATS <= n <= latency.MAX_REPEATS
    assert report.device == "cpu" and report.threads == torch.get_num_threads() and report.n_features == 64
    names = ("latency_p50_ms", "latency_p99_ms", "throughput", "latency_p50_cv")
    assert set(report.scalars()) == {f"{k}_b{b}" for b in sizes for k in names}
    assert report.scalars("int8_")["int8_latency_p99_ms_b8"] == report.p99_ms[1]
    rows = report.table()
    assert [r["batch_size"] for r in rows] == list(sizes) and rows[2]["p50_ms"] == report.p50_ms[2]
    assert model.training  # left as it was found


def test_a_report_summarises_timings_as_percentiles():
    report = LatencyReport()
    report.add(4, [ms / 1000 for ms in range(100, 0, -1)])  # 1..100 ms, in any order
    assert report.p50_ms == [pytest.approx(50.5)] and report.p99_ms == [pytest.approx(99.01)]
    assert report.throughput == [pytest.approx(4 / 0.0505)] and report.repeats == [100]


def test_measure_calls_in_eval_and_inference_mode_on_float32_input():
    log: list = []
    model = Recorder("m", log)
    report = measure(model, 32, (2, 5), repeats=120)
    assert report.repeats == [120, 120]
    assert all(not training and inference and dtype == torch.float32 for _, training, inference, dtype, _ in log)
    shapes = [shape for *_, shape in log]
    assert shapes.count((5, 32)) >= 120 + latency.WARMUP_CALLS  # warm-up first, then the timed calls
    assert shapes.index((5, 32)) > shapes.index((2, 32))
    assert model.training


def test_side_by_side_interleaves_the_models_and_reports_each():
    log: list = []
    models = {"fp32": Recorder("fp32", log), "int8": Recorder("int8", log)}
    reports = measure_side_by_side(models, 32, (1, 16), repeats=100)
    assert set(reports) == {"fp32", "int8"}
    for name, r in reports.items():
        assert r.model == name and r.batch_sizes == [1, 16] and r.repeats == [100, 100]
        assert all(p99 >= p50 > 0 for p50, p99 in zip(r.p50_ms, r.p99_ms))
    timed = [name for name, *_ in log[-200:]]  # the last batch size's timed rounds
    rounds = [tuple(timed[i : i + 2]) for i in range(0, 200, 2)]
    assert all(set(r) == {"fp32", "int8"} for r in rounds)  # every round times both
    assert {r[0] for r in rounds} == {"fp32", "int8"}  # and neither always goes first
    tables = [row for r in reports.values() for row in r.table()]
    assert {row["model"] for row in tables} == {"fp32", "int8"}


def test_the_budget_bounds_the_repeats_but_never_below_a_meaningful_p99():
    spent = measure(nn.Linear(8, 2), 8, (1, 4), budget_s=1e-6)
    assert spent.repeats == [latency.MIN_REPEATS] * 2  # the budget is gone at once: the minimum still runs
    plenty = measure(nn.Identity(), 8, (1,), budget_s=60.0)  # nothing to compute: the cap ends it
    assert plenty.repeats == [latency.MAX_REPEATS]


class Slow(nn.Module):
    def forward(self, x):
        time.sleep(0.02)
        return x


def test_a_model_too_slow_for_a_hundred_calls_stops_at_the_floors_cap_and_says_how_few():
    """A large model would spend minutes of every run on MIN_REPEATS calls of each batch size:
    past `floor_cap_s` it stops (never under FEWEST_REPEATS), and the summary says how few calls
    its p99 came from."""
    from flyscale.evaluate.comparison import Comparison

    reports = measure_side_by_side({"fp32": Slow(), "int8": Slow()}, 8, (1, 4), budget_s=1e-6, floor_cap_s=0.1)
    assert [r.repeats for r in reports.values()] == [[latency.FEWEST_REPEATS] * 2] * 2
    lines = Comparison("dynamic_int8", 0.0, 3.0, reports["fp32"], reports["int8"]).lines()
    assert all(f"({latency.FEWEST_REPEATS} timed calls: a p99 of so few" in line for line in lines)
    longer = measure(Slow(), 8, (1,), budget_s=1e-6, floor_cap_s=0.5)
    assert latency.FEWEST_REPEATS < longer.repeats[0] < latency.MIN_REPEATS


def test_measure_refuses_what_it_cannot_measure():
    with pytest.raises(ValueError, match="batch_sizes"):
        measure(nn.Linear(4, 2), 4, (0,))
    with pytest.raises(ValueError, match="models"):
        measure_side_by_side({}, 4)


# --- plots ----------------------------------------------------------------------------------------


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_the_plots_write_pngs_and_leave_no_figure_open(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    open_before = plt.get_fignums()
    rows = [(two_class_logits(0.95, 0), t) for t in (0, 0, 1, 1)] + [(two_class_logits(0.7, 1), 1)] * 6
    history = TrainHistory(
        "ddp",
        2,
        [
            EpochMetrics(
                epoch=e,
                train_loss=1.0 / (e + 1),
                train_accuracy=None if e == 0 else 0.5 + 0.1 * e,
                val_loss=1.2 / (e + 1),
                val_accuracy=0.6 + 0.1 * e,
                seconds=1.0,
                samples_per_s=100.0,
            )
            for e in range(3)
        ],
    )
    reports = measure_side_by_side({"a": nn.Linear(8, 2), "b": nn.Linear(8, 2)}, 8, (1, 4, 16), repeats=100)
    figures = [
        plots.reliability_diagram(evaluate_logits(rows), "fp32 test", str(tmp_path / "reliability.png")),
        plots.learning_curves(history, str(tmp_path / "curves.png")),
        plots.latency_plot(reports, str(tmp_path / "latency.png")),
        plots.confusion_matrix([[5, 1], [0, 4]], "fp32 test confusion", str(tmp_path / "confusion.png")),
        # Nothing to draw still gives a picture that says so.
        plots.reliability_diagram(EvalMetrics(0.9, 0.9, 0.3, 1, [[1]], 1), "old", str(tmp_path / "empty.png")),
    ]
    assert all(isinstance(f, Figure) for f in figures)
    for name in ("reliability", "curves", "latency", "confusion"):
        assert_png(tmp_path / f"{name}.png")
    assert (tmp_path / "empty.png").stat().st_size > 1000
    assert plt.get_fignums() == open_before  # nothing left in pyplot's registry to leak
    titles = [ax.get_title() for ax in figures[0].axes]
    assert any("ECE 0.3600" in t for t in titles)
    assert len(figures[2].axes[0].get_lines()) >= 2  # one line per model
    matrix = figures[3].axes[0]
    assert matrix.get_title() == "fp32 test confusion" and len(figures[3].axes) == 2  # the matrix and its colour bar
    assert [t.get_text() for t in matrix.texts] == ["5", "1", "0", "4"]  # every cell labelled with its count


def test_the_confusion_matrix_is_drawn_without_pyplot(tmp_path):
    # pyplot keeps global state (every figure alive until closed) and costs its import: a fresh
    # interpreter shows whether drawing a run's figure pulls it in.
    code = (
        "import sys; from flyscale.render import plots; "
        f"plots.confusion_matrix([[5, 1], [0, 4]], 'fp32', {str(tmp_path / 'c.png')!r}); "
        "assert 'matplotlib.pyplot' not in sys.modules, 'drawing imported matplotlib.pyplot'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_png(tmp_path / "c.png")


def test_every_latency_carries_its_spread_and_a_noisy_ratio_is_not_printed_as_exact():
    """The p50's run-to-run spread, from repeated measurements (the calls cut in time order): a
    steady machine gives a narrow one; load that came and went, a wide one, and then the summary
    gives no ratio."""
    from flyscale.evaluate.comparison import Comparison

    steady = [0.001 + 1e-6 * (i % 7) for i in range(500)]
    burst = [0.001 if i < 300 else 0.004 for i in range(500)]  # the machine got busy two fifths in
    assert latency.spread(steady) < 0.01 and latency.spread(burst) > latency.NOISY_CV
    fp32, int8 = LatencyReport(), LatencyReport()
    for b in (1, 64):
        fp32.add(b, steady)
        int8.add(b, burst if b == 1 else steady)
    assert fp32.scalars()["latency_p50_cv_b1"] == fp32.p50_cv[0] and fp32.table()[0]["p50_cv"] == fp32.p50_cv[0]
    lines = Comparison("dynamic_int8", 0.0, 3.0, fp32, int8).lines()
    assert "no ratio: too noisy to trust (p50 moved" in lines[0] and "x" not in lines[0].split("ms")[-1]
    assert lines[1].endswith("1.00x")
