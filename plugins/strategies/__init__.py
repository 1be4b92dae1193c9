"""Training strategies: functions `(model, data, cfg, ctx, options) -> TrainResult`, chosen by name."""
