"""The scaling study: where more data, a bigger model or more workers stops paying. Wiring only.

    pyflyte run workflows/scaling.py scaling_study --cfg configs/scaling-digits.yaml

The preset is any pipeline preset (the study's base point) plus a `scaling:` section that says
what to sweep (flyscale/scaling/plan.py). The data is prepared as the training pipeline prepares it;
then every point is an ordinary cached training run (tasks/scaling.py's dynamic `run_study`),
and the report fits the scaling laws, recommends, publishes a Deck and logs one MLflow parent
run with a child run per point.
"""

from flytekit import workflow

from flyscale.scaling.advice import StudySummary
from flyscale.scaling.config import StudyConfig
from tasks.data import (
    fingerprint_data,
    load_data,
    read_reference,
    split_data,
    validate_data,
)
from tasks.preflight import check_model
from tasks.scaling import (
    close_failed_study,
    report_study,
    run_study,
    summarize_study,
    train_rows,
)


# A task that fails leaves the points' live MLflow runs FAILED, not RUNNING for ever.
@workflow(on_failure=close_failed_study)
def scaling_study(cfg: StudyConfig = StudyConfig()) -> StudySummary:  # noqa: B008 (a Flyte input's default)
    """check the base model -> fingerprint -> load -> validate -> split -> every point (subset, train and measure) -> report -> summary."""
    model = check_model(data_cfg=cfg.data, model_cfg=cfg.model, cfg=cfg.train)
    fingerprint, streaming, examples, text, started = fingerprint_data(cfg=cfg.data, model=model)
    raw, loaded_info, content, load_ran = load_data(cfg=cfg.data, fingerprint=fingerprint)
    reference = read_reference(cfg=cfg.data, store=cfg.mlflow, content=content)
    clean, validated, validate_ran = validate_data(
        raw=raw, info=loaded_info, content=content, cfg=cfg.data, reference=reference, store=cfg.mlflow
    )
    train, val, test, split_ran = split_data(clean=clean, cfg=cfg.data)
    points = run_study(
        cfg=cfg, train=train_rows(train=train), val=val, info=validated.info, fingerprint=content, started=started
    )
    summary = report_study(cfg=cfg, points=points, started=started)
    return summarize_study(summary=summary, started=started)
