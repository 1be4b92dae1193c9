"""Kept for PyTorch models registered before flyscale.tracking.model_io had its name: the
model_code.py each carries imports `predict` from here. New registrations import model_io."""

from flyscale.tracking.model_io import predict

__all__ = ["predict"]
