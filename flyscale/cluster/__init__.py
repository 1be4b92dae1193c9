"""Running on a cluster, and locally as a cluster would: the launchers that start training
workers (a PyTorchJob through flytekitplugins-kfpytorch, or local processes), exit codes by the
PyTorchJob convention, Flyte's checkpoint API, each stage's resources, the pinned task image and
the nightly schedule.

Top room, with `cli` and `api`: it may import every room below. Only tasks/ and workflows/ use it.
"""
