"""Training: the single-device loop (`loop`), its batches, one optimizer step, validation and
telemetry per epoch, the training state and its checkpoints (`checkpoint`, on disk `checkpoint_files`), a
Ctrl-C's stop at a step every rank agrees on (`interrupt`), meta-device models, the preflight,
the progress bar, the strategies chosen by name, and `distributed`, the one module that knows
about ranks.

May import `evaluate`, `data`, `model`, `config`, `plugin` and below; never MLflow or Flyte.
"""
