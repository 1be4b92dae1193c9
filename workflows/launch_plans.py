"""Scheduled retraining: `nightly_retraining` runs training_pipeline every night on the
production data, with inputs fixed at registration, one execution at a time, and a message
when it fails.

    pyflyte register --image <registry>/flyscale@sha256:<digest> --version "$(git rev-parse HEAD)" workflows/

registers and activates it (`auto_activate`). Its settings (flyscale/cluster/schedule.py): the inputs from
configs/cluster/production.yaml (FLYSCALE_PRODUCTION_CONFIG names another file), the schedule
from FLYSCALE_NIGHTLY_CRON (02:00 UTC), the failure e-mails from FLYSCALE_ALERT_EMAILS.

Content-keyed caching makes a night with unchanged data all cache hits: only the tasks that read
live state run (the data's fingerprint, the champion, the summary). New data retrains. A night
still running when the next one is due makes the next one skip, never pile up.
"""

from flytekit import CronSchedule, Email, WorkflowExecutionPhase
from flytekit.models.concurrency import ConcurrencyLimitBehavior, ConcurrencyPolicy

from flyscale.cluster import schedule
from workflows.train import training_pipeline

nightly_retraining = schedule.FixedInputsLaunchPlan.get_or_create(
    training_pipeline,
    name="nightly_retraining",
    schedule=CronSchedule(schedule=schedule.nightly_cron()),
    fixed_inputs={"cfg": schedule.production_config()},
    notifications=[
        Email(
            phases=[WorkflowExecutionPhase.FAILED, WorkflowExecutionPhase.TIMED_OUT, WorkflowExecutionPhase.ABORTED],
            recipients_email=schedule.alert_emails(),
        )
    ],
    auto_activate=True,  # the schedule runs from registration on
    concurrency=ConcurrencyPolicy(max_concurrency=1, behavior=ConcurrencyLimitBehavior.SKIP),
)
