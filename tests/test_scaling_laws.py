"""Scaling-law fits and recommendations on hand-made measurement tables whose right answer is
known: a clear knee, a flat curve, a curve still rising, a power law with known alpha, beta and
gamma plus noise, too few points, and worker counts whose efficiency is or is not worth it. Also
the plan of a study, its nested subsets, its config, and the model-size options it sweeps."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from flyscale.config import ModelConfig
from flyscale.plugin import registry
from flyscale.scaling.advice import StudySummary, analyse, find_knee
from flyscale.scaling.config import ScalingConfig, StudyConfig, point_model
from flyscale.scaling.laws import MIN_FIT_POINTS, fit_power_law
from flyscale.scaling.plan import ScalingPoint, nested_subset, plan, throughput
from flyscale.scaling.worker_count import worker_advice
from flyscale_plugins.datasets import digits
from flyscale_plugins.models import CNN, MLP, CNNOptions, MLPOptions

ALPHA, BETA, GAMMA = 3.0, -0.5, 0.02
SIZES = [100, 200, 400, 800, 1600, 3200, 6400]


def law(m, alpha=ALPHA, beta=BETA, gamma=GAMMA):
    return alpha * np.asarray(m, dtype=float) ** beta + gamma


def true_drop(m, alpha=ALPHA, beta=BETA):
    """What doubling m really removes from the error under the law."""
    return alpha * m**beta * (1 - 2**beta)


def point(axis: str, size: int, val_error: float, train_error: float | None = None, **kw) -> ScalingPoint:
    """A measured point on one axis: `size` is training rows (data) or parameters (model). Unless
    given, its train error is 0.01 under its val error (no over-fitting to speak of)."""
    rows, params = (size, 100_000) if axis == "data" else (5000, size)
    train_error = val_error - 0.01 if train_error is None else train_error
    fields = dict(
        key=f"{axis}{size}",
        axes=[axis],
        data_fraction=1.0,
        width_multiplier=1.0,
        depth_multiplier=1.0,
        workers=1,
        train_rows=rows,
        parameters=params,
        val_metric=val_error,
        train_metric=train_error,
    )
    return ScalingPoint(**{**fields, **kw})


def table(axis: str, sizes, errors, **kw) -> list[ScalingPoint]:
    return [point(axis, s, e, **kw) for s, e in zip(sizes, errors)]


# --- fits ------------------------------------------------------------------------------------


def test_an_exact_power_law_is_recovered_exactly():
    fit = fit_power_law(SIZES, list(law(SIZES)), "data")
    assert fit.meaningful, fit.reason
    assert fit.beta == pytest.approx(BETA, abs=1e-3)
    assert fit.gamma == pytest.approx(GAMMA, abs=1e-4)
    assert fit.alpha == pytest.approx(ALPHA, rel=1e-2)  # reported in the sizes' own units, not normalised ones
    assert fit.r2_log > 0.9999 and fit.rmse_log < 1e-4
    assert fit.drop == pytest.approx(true_drop(6400), rel=1e-3)
    assert fit.largest == 6400


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_noisy_power_law_is_recovered_within_tolerance(seed):
    rng = np.random.default_rng(seed)
    errors = law(SIZES) * np.exp(rng.normal(0.0, 0.02, len(SIZES)))  # 2% multiplicative noise
    fit = fit_power_law(SIZES, list(errors), "data", seed=seed)
    assert fit.meaningful, fit.reason
    assert fit.beta == pytest.approx(BETA, abs=0.1)
    assert fit.gamma == pytest.approx(GAMMA, abs=0.01)
    assert fit.r2_log > 0.98
    # The extrapolation's range holds the truth and is informative (narrower than the drop itself).
    assert fit.drop_low <= true_drop(6400) <= fit.drop_high
    assert fit.drop_low <= fit.drop <= fit.drop_high
    assert 0 < fit.drop_high - fit.drop_low < true_drop(6400)
    assert "Doubling the training rows (6,400 -> 12,800) would lower error by about" in fit.summary()


@pytest.mark.parametrize("seed", [28, 35, 37])
def test_four_points_that_happen_to_fit_closely_still_get_an_honest_range(seed):
    """Four points leave one degree of freedom, so the residuals can understate the noise badly:
    in these studies (3% noise) the residuals are 0.2-0.8%. A range drawn from the residuals
    alone misses the true drop in each of them; one that knows its noise estimate is uncertain
    does not."""
    sizes = [100, 200, 400, 800]
    errors = law(sizes) * np.exp(np.random.default_rng(100 + seed).normal(0.0, 0.03, len(sizes)))
    fit = fit_power_law(sizes, list(errors), "data")
    assert fit.meaningful and fit.rmse_log < 0.01
    assert fit.drop_low <= true_drop(800) <= fit.drop_high


def test_sampling_noise_of_a_small_validation_set_widens_the_range():
    errors = list(law(SIZES))  # a perfect fit: the residuals alone would say there is no doubt
    exact = fit_power_law(SIZES, errors, "data")
    noisy = fit_power_law(SIZES, errors, "data", val_rows=300)
    assert exact.drop_high - exact.drop_low < 1e-3
    assert noisy.drop_high - noisy.drop_low > 5 * (exact.drop_high - exact.drop_low)


@pytest.mark.parametrize("sizes", [[100, 200, 400], [100, 100, 200, 200, 400, 400]])
def test_too_few_sizes_give_no_fit_and_say_why(sizes):
    """Three parameters through three sizes always fit exactly: no fit, not a perfect one."""
    assert MIN_FIT_POINTS == 4
    fit = fit_power_law(sizes, list(law(sizes)), "data")
    assert not fit.meaningful
    assert "3 distinct sizes" in fit.reason and "at least 4" in fit.reason
    assert fit.summary().startswith("error vs training rows: no fit (3 distinct sizes")


def test_a_flat_curve_has_no_power_law_region():
    fit = fit_power_law([100, 200, 400, 800, 1600], [0.050, 0.049, 0.051, 0.050, 0.0495], "data")
    assert not fit.meaningful and "flat" in fit.reason and fit.beta == 0.0


def test_a_drop_inside_the_validation_sets_noise_is_flat():
    errors = [0.060, 0.057, 0.055, 0.053, 0.052]  # falls by 0.008: 2 rows of 270
    assert fit_power_law([100, 200, 400, 800, 1600], errors, "data").meaningful
    fit = fit_power_law([100, 200, 400, 800, 1600], errors, "data", val_rows=270)
    assert not fit.meaningful and "flat" in fit.reason


def test_a_loss_curve_is_judged_by_the_noise_measured_with_it():
    """A loss has no binomial noise: each point's measured standard error decides what is a drop."""
    sizes, losses = [1e4, 2e4, 4e4, 8e4, 1.6e5], list(law([1e4, 2e4, 4e4, 8e4, 1.6e5], 40.0, -0.3, 1.5))
    quiet = fit_power_law(sizes, losses, "data", noise=[0.001] * 5, metric="loss", noun="training tokens")
    assert quiet.meaningful and quiet.beta == pytest.approx(-0.3, abs=0.05)
    assert quiet.summary().startswith("loss vs training tokens: ") and "would lower loss by about" in quiet.summary()
    drop = losses[0] - losses[-1]
    loud = fit_power_law(sizes, losses, "data", noise=[drop] * 5, metric="loss", noun="training tokens")
    assert not loud.meaningful and "loss is flat" in loud.reason
    # The measured noise also sets the range: the same curve, measured 30 times less precisely.
    rough = fit_power_law(sizes, losses, "data", noise=[0.03] * 5, metric="loss")
    assert rough.drop_high - rough.drop_low > 5 * (quiet.drop_high - quiet.drop_low)


def test_a_language_model_study_reads_in_tokens_and_loss():
    sizes = [10_000, 20_000, 40_000, 80_000]
    points = [
        point("data", s // 63, v, v - 0.05, metric="loss", val_noise=0.01, unit="token", train_units=s)
        for s, v in zip(sizes, law(sizes, 40.0, -0.3, 1.5))
    ]
    result = analyse(points, ScalingConfig(max_gap=0.2))
    assert result.metric == "loss" and result.data_noun == "training tokens"
    assert result.data_fit.meaningful and result.data_fit.largest == 80_000  # tokens, not rows
    assert result.data_knee.sentence.startswith("data: 80,000 training tokens (fraction 1, 1,269 rows)")
    assert any("train/val gap at 80,000 training tokens: 0.0500" in r for r in result.bound.reasons)
    assert "val loss" in str(StudySummary(result)) and "80,000 tokens" in str(StudySummary(result))


def test_a_curve_still_rising_has_no_power_law_region():
    fit = fit_power_law([100, 200, 400, 800, 1600], [0.05, 0.07, 0.09, 0.12, 0.15], "parameters")
    assert not fit.meaningful and "rises with size" in fit.reason


def test_a_curve_that_turns_up_again_has_no_power_law_region():
    fit = fit_power_law([100, 200, 400, 800, 1600], [0.20, 0.10, 0.06, 0.09, 0.14], "parameters")
    assert not fit.meaningful and "rises after 400" in fit.reason


def test_a_cliff_between_two_sizes_is_no_power_law():
    """A drop from 0.14 to 0.03 between two sizes and nothing after: any beta fits the step."""
    fit = fit_power_law([1266, 2778, 6570, 50826], [0.1407, 0.0296, 0.0370, 0.0296], "parameters", val_rows=270)
    assert not fit.meaningful
    assert "cliff" in fit.reason and "between 1,266 and 2,778; measure sizes in between" in fit.reason


def test_points_that_do_not_follow_the_form_give_no_fit():
    fit = fit_power_law([100, 200, 400, 800, 1600, 3200], [0.30, 0.10, 0.29, 0.08, 0.28, 0.07], "data")
    assert not fit.meaningful and "do not follow a power law" in fit.reason


# --- knees -----------------------------------------------------------------------------------


KNEE_SIZES = [50, 100, 200, 400, 800]
KNEE_ERRORS = [0.30, 0.12, 0.065, 0.046, 0.040]


def test_the_knee_is_the_smallest_size_within_tolerance_of_the_best():
    knee = find_knee(table("data", KNEE_SIZES, KNEE_ERRORS), "data", tolerance=0.01)
    assert knee.found and knee.size == 400 and knee.value == 0.046
    assert knee.best_size == 800 and knee.best_value == 0.040
    assert "400 training rows" in knee.sentence and "within 0.0100 of the best" in knee.sentence
    assert find_knee(table("data", KNEE_SIZES, KNEE_ERRORS), "data", tolerance=0.03).size == 200
    best = find_knee(table("data", KNEE_SIZES, KNEE_ERRORS), "data", tolerance=0.0)
    assert best.size == 800
    assert "has the best val error (0.0400); no smaller size measured comes within" in best.sentence


def test_on_a_flat_curve_the_knee_is_the_smallest_size():
    knee = find_knee(table("model", [1000, 4000, 16000], [0.05, 0.049, 0.051]), "model", tolerance=0.01)
    assert knee.size == 1000 and "1,000 parameters" in knee.sentence


def test_a_rising_curve_has_its_knee_at_the_smallest_size_too():
    knee = find_knee(table("model", [1000, 4000, 16000], [0.05, 0.09, 0.15]), "model", tolerance=0.01)
    assert knee.size == 1000 and knee.best_size == 1000


def test_one_size_is_no_knee():
    assert not find_knee(table("data", [100], [0.1]), "data", 0.01).found


# --- data-bound or capacity-bound ------------------------------------------------------------


def _study(data_errors, model_errors, train_error=None, **cfg):
    data = table("data", SIZES, data_errors, train_error=train_error)
    model = table("model", [1000, 2000, 4000, 8000, 16000], model_errors, train_error=train_error)
    return analyse(data + model, ScalingConfig(**cfg))


FLAT = [0.050, 0.049, 0.051, 0.050, 0.0495]


def test_error_still_falling_with_data_is_data_bound():
    result = _study(list(law(SIZES, alpha=10.0)), FLAT)
    assert result.data_fit.meaningful and result.data_fit.drop > 0.005
    assert result.bound.verdict == "data-bound" and result.bound.advice == "collect or augment more data"
    assert not result.model_fit.meaningful and "flat" in result.model_fit.reason
    assert any("doubling the data would lower val error by about" in r for r in result.bound.reasons)


def test_error_still_falling_with_parameters_is_capacity_bound():
    flat_data = [0.050, 0.049, 0.051, 0.050, 0.0495, 0.050, 0.0502]
    result = _study(flat_data, list(law([1000, 2000, 4000, 8000, 16000], alpha=20.0)))
    assert result.bound.verdict == "capacity-bound" and result.bound.advice == "use a bigger model"


def test_a_large_train_val_gap_is_data_bound_even_on_a_flat_curve():
    flat_data = [0.100, 0.099, 0.101, 0.100, 0.0995, 0.100, 0.1002]
    result = _study(flat_data, [0.100, 0.099, 0.101, 0.100, 0.0995], train_error=0.0, max_gap=0.05)
    assert result.bound.verdict == "data-bound" and result.bound.gap_large
    assert result.bound.gap == pytest.approx(0.1002)
    calm = _study(flat_data, [0.100, 0.099, 0.101, 0.100, 0.0995], train_error=0.08, max_gap=0.05)
    assert calm.bound.verdict == "neither" and not calm.bound.gap_large


def test_both_curves_falling_is_both_bound():
    result = _study(list(law(SIZES, alpha=10.0)), list(law([1000, 2000, 4000, 8000, 16000], alpha=20.0)))
    assert result.bound.verdict == "data- and capacity-bound"


def test_without_a_fit_the_last_two_sizes_decide_and_noise_is_not_a_gain():
    # Three sizes: no fit, but the last doubling still removed 0.04 of error.
    points = table("data", [100, 200, 400], [0.20, 0.12, 0.08], val_rows=1000)
    result = analyse(points, ScalingConfig())
    assert not result.data_fit.meaningful and result.bound.verdict == "data-bound"
    assert "0.1200 -> 0.0800" in result.bound.reasons[0] and "no fit: 3 distinct sizes" in result.bound.reasons[0]
    # The same drop measured on 50 validation rows is inside the sampling noise: not evidence.
    noisy = analyse(table("data", [100, 200, 400], [0.20, 0.12, 0.08], val_rows=50), ScalingConfig())
    assert noisy.bound.verdict == "neither"


@pytest.mark.parametrize("fitted", [True, False])
def test_a_study_result_crosses_a_task_boundary(fitted):
    """The report's output goes through Flyte's type engine: no numpy scalar may hide in it."""
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    sizes = SIZES if fitted else [100, 200, 400]
    points = table("data", sizes, list(law(sizes)), val_rows=270) + _workers({1: 1000.0, 2: 1500.0})
    summary = StudySummary(analyse(points, ScalingConfig()), parent_run_id="abc")
    ctx = FlyteContextManager.current_context()
    literal = TypeEngine.to_literal(ctx, summary, StudySummary, TypeEngine.to_literal_type(StudySummary))
    back = TypeEngine.to_python_value(ctx, literal, StudySummary)
    assert back.result.bound == summary.result.bound and back.result.data_fit == summary.result.data_fit
    assert str(back) == str(summary)


# --- workers ---------------------------------------------------------------------------------


def _workers(speeds: dict[int, float]) -> list[ScalingPoint]:
    return [point("workers", 5000, 0.05, workers=n, samples_per_s=s, key=f"w{n}") for n, s in speeds.items()]


def test_two_workers_that_barely_beat_one_recommend_one_worker():
    advice = worker_advice(_workers({1: 10_000.0, 2: 11_000.0}), min_efficiency=0.7)
    assert advice.measured and advice.workers == 1
    assert [round(r.efficiency, 3) for r in advice.table] == [1.0, 0.55]
    assert advice.table[1].speedup == pytest.approx(1.1)
    assert advice.sentence.startswith("workers: use one worker: 2 workers reach efficiency 0.55")


def test_workers_are_added_while_every_count_stays_efficient():
    advice = worker_advice(_workers({1: 1000.0, 2: 1900.0, 4: 3600.0, 8: 4000.0}), min_efficiency=0.7)
    assert advice.workers == 4 and "8 workers reach efficiency 0.50" in advice.sentence
    assert worker_advice(_workers({1: 1000.0, 2: 1900.0, 4: 3600.0}), 0.7).workers == 4
    # A dip stops the count even if a later one recovers: efficiency must hold all the way up.
    assert worker_advice(_workers({1: 1000.0, 2: 1000.0, 4: 3600.0}), 0.7).workers == 1


def test_the_advice_answers_a_communication_bound_training_instead_of_contradicting_it():
    """The issue seen: a study recommended 2 workers while its training at 2 workers warned it was
    communication-bound. Both now rest on the same steady epochs, and the advice says what it makes
    of the warning, whichever way it goes."""
    bound = "communication-bound: gradient all-reduces are in flight 48% of each step on 2 workers"
    pays = _workers({1: 1000.0, 2: 1800.0})
    pays[1] = dataclasses.replace(pays[1], diagnosis=bound)
    advice = worker_advice(pays, min_efficiency=0.7)
    assert advice.workers == 2
    assert "the training on 2 worker(s) found its collectives in flight much of each step" in advice.sentence
    assert "the speed-up measured over the same epochs is what that costs, and it still pays" in advice.sentence
    slow = _workers({1: 1000.0, 2: 1100.0})
    slow[1] = dataclasses.replace(slow[1], diagnosis=bound)
    advice = worker_advice(slow, min_efficiency=0.7)
    assert advice.workers == 1 and "the training on 2 worker(s) was communication-bound, which is" in advice.sentence
    assert "found its collectives" not in worker_advice(_workers({1: 1000.0, 2: 1800.0}), 0.7).sentence


def test_efficiency_is_against_the_fewest_workers_measured():
    advice = worker_advice(_workers({2: 2000.0, 4: 3800.0}), min_efficiency=0.9)
    assert advice.workers == 4 and advice.table[1].efficiency == pytest.approx(0.95)


def test_one_worker_count_is_not_a_measurement():
    advice = worker_advice(_workers({2: 2000.0}), 0.7)
    assert not advice.measured and "not swept" in advice.sentence


def test_throughput_skips_the_warm_up_epoch():
    assert throughput([100.0, 1000.0, 1200.0, 1100.0]) == (1100.0, 1050.0, 1150.0)
    assert throughput([500.0]) == (500.0, 500.0, 500.0) and throughput([]) == (0.0, 0.0, 0.0)


def test_an_efficiency_whose_epochs_straddle_the_threshold_says_so():
    points = _workers({1: 10_000.0, 2: 15_000.0})  # efficiency 0.75
    points[0].samples_per_s_low, points[0].samples_per_s_high = 8_000.0, 12_000.0
    points[1].samples_per_s_low, points[1].samples_per_s_high = 12_000.0, 18_000.0
    advice = worker_advice(points, min_efficiency=0.7)
    assert advice.workers == 2
    assert advice.table[1].low == pytest.approx(0.5) and advice.table[1].high == pytest.approx(1.125)
    assert "efficiency 0.75 (0.50-1.12)" in advice.sentence
    assert "puts 2 worker(s) on both sides of the threshold: measure again" in advice.sentence
    steady = _workers({1: 10_000.0, 2: 15_000.0})  # no spread measured: no doubt claimed
    assert "both sides" not in worker_advice(steady, 0.7).sentence


# --- the plan and its data -------------------------------------------------------------------


def test_the_plan_sweeps_one_axis_at_a_time_around_the_base_point():
    cfg = ScalingConfig(
        data_fractions=[0.25, 0.5], width_multipliers=[0.5, 2.0], depth_multipliers=[2.0], workers=[2], base_workers=1
    )
    points = {p.key: p for p in plan(cfg)}
    base = "data1-width1-depth1-workers1"
    assert points[base].axes == ["data", "model", "workers"]  # on every axis, listed or not
    assert set(points) == {
        base,
        "data0.25-width1-depth1-workers1",
        "data0.5-width1-depth1-workers1",
        "data1-width0.5-depth1-workers1",
        "data1-width2-depth1-workers1",
        "data1-width1-depth2-workers1",
        "data1-width1-depth1-workers2",
    }
    assert points["data1-width1-depth1-workers2"].axes == ["workers"]
    only_workers = plan(ScalingConfig(data_fractions=[], width_multipliers=[], workers=[1, 2]))
    assert [(p.workers, p.axes) for p in only_workers] == [(1, ["workers"]), (2, ["workers"])]


def test_subsets_are_nested_stratified_and_seeded():
    labels = np.repeat(np.arange(10), 100)
    np.random.default_rng(0).shuffle(labels)
    subsets = [set(nested_subset(labels, f, seed=7)) for f in (0.1, 0.25, 0.5, 1.0)]
    assert all(small < large for small, large in zip(subsets, subsets[1:]))  # each inside the next
    assert [len(s) for s in subsets] == [100, 250, 500, 1000]
    assert all(sum(labels[i] == c for i in subsets[0]) == 10 for c in range(10))  # every class, in proportion
    assert set(nested_subset(labels, 0.1, seed=7)) == subsets[0]
    assert set(nested_subset(labels, 0.1, seed=8)) != subsets[0]


def test_a_rare_class_keeps_a_row():
    labels = np.array([0] * 100 + [1] * 2)
    assert 1 in labels[nested_subset(labels, 0.1, seed=0)]


# --- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"data_fractions": [0.5, 1.5]}, "scaling.data_fractions must each be in (0, 1]"),
        ({"data_fractions": [0.5, 0.5]}, "scaling.data_fractions lists a value twice"),
        ({"width_multipliers": [0.0]}, "scaling.width_multipliers must each be > 0"),
        ({"workers": [0, 1]}, "scaling.workers, scaling.base_workers and scaling.threads_per_worker must be >= 1"),
        (
            {"threads_per_worker": 0},
            "scaling.workers, scaling.base_workers and scaling.threads_per_worker must be >= 1",
        ),
        ({"data_fractions": [], "width_multipliers": [], "workers": []}, "scaling: nothing to sweep"),
        ({"tolerance": 2.0}, "scaling.tolerance must be in [0.0, 1.0]"),
        ({"min_efficiency": 0.0}, "scaling.min_efficiency must be in [0.01, 1.0]"),
        ({"worker": [1]}, "scaling.worker: unknown field; did you mean 'workers'?"),
    ],
)
def test_bad_scaling_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError) as exc:
        ScalingConfig(**kwargs)
    assert message in str(exc.value)


def test_a_preset_is_a_pipeline_preset_plus_a_scaling_section():
    cfg = StudyConfig.from_json(json.dumps({"train": {"epochs": 2}, "scaling": {"data_fractions": [0.5]}}))
    assert cfg.train.epochs == 2 and cfg.scaling.data_fractions == [0.5] and cfg.scaling.workers == [1, 2]
    with pytest.raises(ValueError, match=r"scaling.data_fraction: unknown field; did you mean 'data_fractions'\?"):
        StudyConfig.from_json(json.dumps({"scaling": {"data_fraction": [0.5]}}))
    with pytest.raises(ValueError, match=r"unknown config section 'scalng'"):
        StudyConfig.from_json(json.dumps({"scalng": {}}))


class _Fixed:
    """A model plugin whose options declare no size multipliers."""

    def build(self, options, info):
        from torch import nn

        return nn.Sequential(nn.Linear(64, info.num_classes))


def test_sweeping_a_model_without_the_option_is_refused_before_any_work():
    registry.models.register("fixed_size", _Fixed())
    try:
        with pytest.raises(
            ValueError, match="scaling.width_multipliers: model 'fixed_size' declares no width_multiplier option"
        ):
            StudyConfig(model=ModelConfig(name="fixed_size"))
        StudyConfig(model=ModelConfig(name="fixed_size"), scaling=ScalingConfig(width_multipliers=[]))  # no model axis
    finally:
        registry.models.unregister("fixed_size")


def test_a_multiplier_that_empties_a_layer_is_refused_naming_the_sweep():
    with pytest.raises(
        ValueError,
        match=r"scaling.width_multipliers: multiplier 0.001 gives an unusable model: "
        r"model.options: width_multiplier 0.001 leaves a layer",
    ):
        StudyConfig(scaling=ScalingConfig(width_multipliers=[0.001]))


def test_point_models_multiply_the_base_models_own_multiplier():
    base = ModelConfig(name="mlp", options={"hidden": [64, 32], "width_multiplier": 2.0})
    halved = point_model(base, "width_multiplier", 0.5)
    assert halved.plugin.options.width_multiplier == 1.0
    assert halved.options == {"hidden": [64, 32]}  # canonical: 1.0 is the default, so it is not spelled out
    assert point_model(base, "depth_multiplier", 2.0).plugin.options.layers() == [128, 128, 64, 64]


# --- the size options of the built-in models -------------------------------------------------


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_mlp_multipliers_change_width_and_depth_and_default_to_the_sizes_as_given():
    info = digits.info(None)
    assert MLPOptions().layers() == [256, 128]
    shapes = [tuple(m.weight.shape) for m in MLP().build(MLPOptions(), info) if hasattr(m, "weight")]
    assert shapes == [(256, 64), (128, 256), (10, 128)]  # unchanged by the new options
    assert MLPOptions(width_multiplier=0.5).layers() == [128, 64]
    assert MLPOptions(depth_multiplier=2).layers() == [256, 256, 128, 128]
    assert MLPOptions(depth_multiplier=0.5).layers() == [256]
    sizes = [_params(MLP().build(MLPOptions(width_multiplier=w), info)) for w in (0.25, 0.5, 1.0, 2.0)]
    assert sizes == sorted(sizes) and sizes[-1] > 3 * sizes[1]


def test_cnn_multipliers_scale_channels_hidden_and_convolutions():
    assert CNNOptions().sizes() == ([32, 64], 128)
    assert CNNOptions(width_multiplier=0.5, depth_multiplier=1.5).sizes() == ([16, 16, 32], 64)
    model = CNN().build(CNNOptions(width_multiplier=0.25), digits.info(None))
    assert [m.out_channels for m in model if hasattr(m, "out_channels")] == [8, 16]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"width_multiplier": 0}, "width_multiplier must be a number > 0"),
        ({"depth_multiplier": -1.0}, "depth_multiplier must be a number > 0"),
        ({"width_multiplier": "wide"}, "model.options.width_multiplier: expected a number, got 'wide'"),
        ({"depth_multiplier": 0.2}, "depth_multiplier 0.2 leaves none of the 2 layers"),
        ({"width_multiplier": 0.001}, "use a multiplier of at least"),
    ],
)
def test_bad_multipliers_are_refused_with_what_to_do(options, message):
    with pytest.raises(ValueError) as exc:
        ModelConfig(name="mlp", options=options)
    assert message in str(exc.value) and str(exc.value).startswith("model.options")
