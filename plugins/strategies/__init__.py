"""Training strategies: functions `(model, data, cfg, ctx) -> TrainResult`, chosen by name."""
