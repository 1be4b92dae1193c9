"""Hyperparameter search: Optuna's sampler and pruner over any model, objective or training
field, each trial the pipeline's own cached training task, the best trial's config then taken
through the whole pipeline (gates, registration) once. Wiring only.

    pyflyte run workflows/search.py hyperparameter_search --cfg configs/search-digits.yaml

The preset is any pipeline preset (the base of every trial) plus a `search:` section
(flyscale/search/config.py). A rerun of the same preset asks the same trials, which come from
the cache.
"""

from flytekit import workflow

from flyscale.search.config import SearchStudyConfig
from flyscale.search.report import SearchSummary
from tasks.data import fingerprint_data
from tasks.preflight import check_model, preflight_check
from tasks.search import base_config, best_config, close_failed_search, finish_search, open_study, run_trials
from workflows.data import dataset
from workflows.train import training_pipeline


@workflow(on_failure=close_failed_search)
def hyperparameter_search(cfg: SearchStudyConfig = SearchStudyConfig()) -> SearchSummary:  # noqa: B008
    """check the base model -> fingerprint -> the pipeline's data branch (once, for every trial) ->
    the preflight of the base config (once: the workers every trial trains on) -> rounds of trials (train, report, prune, tell) -> the best config through the training pipeline
    -> summary."""
    model = check_model(
        data_cfg=cfg.data,
        model_cfg=cfg.model,
        cfg=cfg.train,
        objective=cfg.objective,
        tokenize=cfg.tokenize,
        mlflow_cfg=cfg.mlflow,
    )
    fingerprint, kind, tokenizer, started = fingerprint_data(cfg=cfg.data, tokenize=cfg.tokenize, model=model)
    base = base_config(cfg=cfg)
    train, val, test, validated, runs = dataset(cfg=base, fingerprint=fingerprint, kind=kind, tokenizer=tokenizer)
    # Once, on the base config: the workers every trial trains on (FLYSCALE_NPROC_PER_NODE=auto).
    preflight, _ = preflight_check(
        train=train,
        val=val,
        info=validated.info,
        model_cfg=base.model,
        cfg=base.train,
        preflight_cfg=base.preflight,
        objective=base.objective,
    )
    at = open_study(cfg=cfg, started=started)
    results = run_trials(
        cfg=cfg,
        at=at,
        done=[],
        train=train,
        val=val,
        info=validated.info,
        fingerprint=validated.content,
        started=started,
        preflight=preflight,
    )
    best = best_config(cfg=cfg, at=at, results=results)
    summary = training_pipeline(cfg=best)
    return finish_search(cfg=cfg, at=at, results=results, summary=summary)
