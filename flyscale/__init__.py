"""flyscale: a training pipeline on Flyte, in rooms that import one way (docs/architecture.md).

From the top (a room may import only the rooms below it; import-linter checks it, see
pyproject.toml):

- `cli`, `api`, `cluster`: the `flyscale` command; the stable surface for plugin authors; running
  on a cluster or in local worker processes.
- `scaling`: scaling studies.
- `render`: figures, Decks, the validation report, the run summary.
- `tracking`: MLflow: runs, model versions, the champion.
- `train`: the loop, checkpoints, strategies, and the one module that knows about ranks.
- `evaluate`: metrics, latency, quantization, gates.
- `data`, `model`: datasets, validation, splits, streaming; building and saving models.
- `flyte`, `config`: cache keys, memos and Flyte types; the typed, strict configuration.
- `plugin`: the plugin registries and contracts.
- `errors`, `settings`: user errors; every FLYSCALE_* environment variable.

Flyte tasks (tasks/) and workflows (workflows/) wire these together; the built-in plugins
(plugins/, installed as `flyscale_plugins`) build on `flyscale.api`. The core imports neither.
"""
