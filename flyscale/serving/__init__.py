"""Serving registered models: model repositories for batching servers (MLServer, Triton),
servers on loopback in environments of their own, and load tests of them (`flyscale loadtest`)."""
