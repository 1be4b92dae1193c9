"""The nightly retraining's settings, read when the workflow is registered (workflows/launch_plans.py
wires them into its launch plan).

- FLYSCALE_PRODUCTION_CONFIG: the pipeline config the nightly runs get as fixed inputs
  (default configs/cluster/production.yaml: the production data's URI, the model's name);
- FLYSCALE_NIGHTLY_CRON: when (default 02:00 UTC);
- FLYSCALE_ALERT_EMAILS: who hears of a failed night (comma-separated).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from flytekit import LaunchPlan

from flyscale import config, settings

DEFAULT_PRODUCTION = Path(__file__).resolve().parents[2] / settings.PRODUCTION_CONFIG.default


def production_config() -> config.PipelineConfig:
    path = Path(settings.PRODUCTION_CONFIG.get()) if settings.PRODUCTION_CONFIG.is_set() else DEFAULT_PRODUCTION
    if not path.is_file():
        raise FileNotFoundError(f"FLYSCALE_PRODUCTION_CONFIG: {path} does not exist (the nightly retraining's inputs)")
    return config.from_dict(yaml.safe_load(path.read_text()) or {})


def nightly_cron() -> str:
    return settings.NIGHTLY_CRON.get()


def alert_emails() -> list[str]:
    raw = settings.ALERT_EMAILS.get()
    return [address.strip() for address in raw.split(",") if address.strip()]


class FixedInputsLaunchPlan(LaunchPlan):
    """flytekit's LaunchPlan, whose fixed inputs stay fixed when it runs locally too.

    flytekit 1.16's local `pyflyte run` of a launch plan passes the workflow's default for every
    input, the fixed ones included, and `LaunchPlan.__call__` lets passed values win over fixed
    ones, so `pyflyte run workflows/launch_plans.py nightly_retraining` would train on
    `PipelineConfig()`. On a cluster Flyte applies the fixed inputs and refuses others; this does
    the same locally.
    """

    def __call__(self, *args, **kwargs):
        fixed = set(getattr(self, "_raw_fixed_inputs", {}) or {})
        return super().__call__(*args, **{name: value for name, value in kwargs.items() if name not in fixed})
