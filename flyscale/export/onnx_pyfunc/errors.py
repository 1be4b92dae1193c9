"""The served model's answers that are not predictions: one line each, never a stack trace."""

from __future__ import annotations

import sys

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE

# Served by MLServer, a refusal is also its MLServerError, which its V2 endpoint answers with the
# error's status and message (any other exception is a bare 500). Looked up, never imported: the
# model's requirements do not include MLServer.
_SERVER_ERRORS: tuple = (sys.modules["mlserver.errors"].MLServerError,) if "mlserver.errors" in sys.modules else ()


class OneLine(MlflowException, *_SERVER_ERRORS):  # type: ignore[misc]
    """An answer in one line, with its error code's HTTP status and no stack trace.

    MLflow's scoring server answers an MlflowException raised in predict with its error code's
    status and its message, after rewriting the message as "Failed to predict data '<the whole
    input>'. \\nError: ..." (mlflow 3.17, pyfunc/scoring_server). The message is kept as first set,
    so the answer is this line alone; any other exception would become a generic message with a
    stack trace."""

    def __init__(self, message: str, error_code: int = INTERNAL_ERROR):
        super().__init__(message, error_code=error_code)
        self.status_code = self.get_http_status_code()  # MLServer's

    @property
    def message(self) -> str:
        return self._message

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_message"):
            self._message = value


class InvalidInput(OneLine, ValueError):
    """A request the model cannot answer (HTTP 400), in one line that names the problem and not
    the input. A ValueError too, for callers in Python."""

    def __init__(self, message: str):
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)
