"""Evaluation after training: test-set metrics, latency per batch size, quantization, the int8
model against the fp32 one, and the gates' verdicts.

May import `data`, `model`, `config`, `plugin` and below; it knows nothing of MLflow or Flyte.
"""
