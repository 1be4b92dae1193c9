"""Training strategies: callables `(model, data, cfg, ctx, options, hooks) -> TrainResult`, chosen by name."""
