"""MLflow, and only here: the tracking store and client settings (`store`), the live run during
training (`live`), the reference new data is checked against (`reference`), what a run logs
(`run_log`), registering model versions (`publish`), the champion alias and its promotion lock
(`champion`), the register stage as one record (`registration`), and the model from code that
serves a registered version (`model_code`, `model_spec`).

May import `train`, `evaluate`, `data`, `model`, `flyte`, `config` and below.
"""
