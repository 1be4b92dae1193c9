"""The scaling study: where more data, a bigger model or more workers stops paying. Wiring only.

    pyflyte run workflows/scaling.py scaling_study --cfg configs/scaling-digits.yaml
    pyflyte run workflows/scaling.py scaling_study --cfg configs/scaling-text-gpt.yaml

The preset is any pipeline preset (the study's base point) plus a `scaling:` section that says
what to sweep (flyscale/scaling/plan.py). The data is prepared by the training pipeline's own
data branch (a table, typed examples, or text tokenized and packed); then every point is an
ordinary cached training run (tasks/scaling.py's dynamic `run_study`), measured through the
objective (a classifier's error, a language model's loss), and the report fits the scaling laws,
recommends, publishes a Deck and logs one MLflow parent run with a child run per point.
"""

from flytekit import workflow

from flyscale.scaling.advice import StudySummary
from flyscale.scaling.config import StudyConfig
from tasks.data import fingerprint_data
from tasks.preflight import check_model
from tasks.scaling import close_failed_study, data_pipeline, report_study, run_study, summarize_study
from workflows.data import dataset


# A task that fails leaves the points' live MLflow runs FAILED, not RUNNING for ever.
@workflow(on_failure=close_failed_study)
def scaling_study(cfg: StudyConfig = StudyConfig()) -> StudySummary:  # noqa: B008 (a Flyte input's default)
    """check the base model -> fingerprint -> the pipeline's data branch -> every point (subset, train
    and measure) -> report -> summary."""
    model = check_model(
        data_cfg=cfg.data, model_cfg=cfg.model, cfg=cfg.train, objective=cfg.objective, tokenize=cfg.tokenize
    )
    fingerprint, kind, tokenizer, started = fingerprint_data(cfg=cfg.data, tokenize=cfg.tokenize, model=model)
    # Not nested in a conditional of its own: flytekit's local executor runs every branch of a
    # conditional inside a sub-workflow that a conditional branch calls.
    train, val, test, validated, runs = dataset(
        cfg=data_pipeline(cfg=cfg), fingerprint=fingerprint, kind=kind, tokenizer=tokenizer
    )
    points = run_study(
        cfg=cfg, train=train, val=val, info=validated.info, fingerprint=validated.content, started=started
    )
    summary = report_study(cfg=cfg, points=points, started=started)
    return summarize_study(summary=summary, started=started)
