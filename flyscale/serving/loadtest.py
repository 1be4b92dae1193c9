"""A bounded, closed-loop load test of a model server on loopback.

At each concurrency level, that many clients each send a request, wait for the answer, and send
the next, until the level's request budget is spent: a closed loop, so the server is never
offered more than it can queue, and a slow server shows as latency and lower throughput rather
than as an unbounded backlog. Each client keeps one HTTP connection open (as a load balancer's
pool would).

What a level reports: p50 and p99 latency of the answered requests, throughput (answered
requests a second of the level's wall time), and the error rate (anything but HTTP 200, or no
answer at all). From the levels, `replicas` says how many servers a target QPS needs at a p99
target: the target over the best throughput any level reached within that p99.

The client shares the machine with the server, so on a small machine the numbers are the pair's;
the ratios between levels and between servers measured in the same run are what to read.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import numpy as np

LEVELS = (1, 4, 16, 64)


@dataclass
class Level:
    """What one concurrency level measured."""

    concurrency: int
    requests: int  # sent
    errors: int  # not answered with HTTP 200
    p50_ms: float
    p99_ms: float
    throughput: float  # answered requests a second
    seconds: float  # the level's wall time
    first_error: str = ""

    @property
    def error_rate(self) -> float:
        return self.errors / max(self.requests, 1)


@dataclass
class LoadReport:
    """Every level of one server setup ("mlserver, adaptive batching up to 32", say)."""

    setup: str
    url: str
    levels: list[Level] = field(default_factory=list)

    def best_within(self, p99_ms: float) -> Level | None:
        """The level with the highest throughput whose p99 is within `p99_ms` and that lost nothing."""
        fine = [lv for lv in self.levels if lv.p99_ms <= p99_ms and lv.errors == 0]
        return max(fine, key=lambda lv: lv.throughput) if fine else None

    def replicas(self, target_qps: float, p99_ms: float) -> int | None:
        """Servers like this one that `target_qps` needs with every request within `p99_ms` (p99);
        None when no level met the p99 target."""
        best = self.best_within(p99_ms)
        return math.ceil(target_qps / best.throughput) if best is not None and best.throughput > 0 else None

    def rows(self) -> list[dict]:
        """One row per level, for a table (MLflow's log_table, the CLI's print)."""
        return [{"setup": self.setup, **asdict(lv), "error_rate": lv.error_rate} for lv in self.levels]


def scalars(levels, prefix: str) -> dict[str, float]:
    """Metrics of each level (anything with concurrency, p50_ms, p99_ms, throughput, errors and
    requests): `<prefix>_c<clients>_latency_p50_ms`, `_latency_p99_ms`, `_throughput` and `_error`
    (the share of requests not answered), named so gates know which way each is better."""
    out: dict[str, float] = {}
    for lv in levels:
        k = f"{prefix}_c{lv.concurrency}"
        out[f"{k}_latency_p50_ms"] = lv.p50_ms
        out[f"{k}_latency_p99_ms"] = lv.p99_ms
        out[f"{k}_throughput"] = lv.throughput
        out[f"{k}_error"] = lv.errors / max(lv.requests, 1)
    return out


def run_level(url: str, body: bytes, concurrency: int, requests: int, timeout_s: float = 60.0) -> Level:
    """`requests` POSTs of `body` to `url` from `concurrency` closed-loop clients."""
    if concurrency < 1 or requests < 1:
        raise ValueError(f"concurrency and requests must be >= 1, got {concurrency} and {requests}")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"a load test needs an http:// URL, got {url!r}")
    host, port = parts.hostname, parts.port or 80
    lock = threading.Lock()
    left = [requests]
    latencies: list[float] = []
    errors: list[str] = []

    def take() -> bool:
        with lock:
            if left[0] == 0:
                return False
            left[0] -= 1
            return True

    def client() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        headers = {"Content-Type": "application/json"}
        while take():
            start = time.perf_counter()
            try:
                conn.request("POST", parts.path or "/", body=body, headers=headers)
                response = conn.getresponse()
                payload = response.read()
                ok = response.status == 200
                problem = "" if ok else f"HTTP {response.status}: {payload[:200].decode(errors='replace')}"
            except (OSError, http.client.HTTPException) as exc:
                ok, problem = False, f"{type(exc).__name__}: {exc}"
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
            elapsed = time.perf_counter() - start
            with lock:
                if ok:
                    latencies.append(elapsed)
                else:
                    errors.append(problem)
        conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(min(concurrency, requests))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    ms = np.asarray(latencies) * 1000
    return Level(
        concurrency=concurrency,
        requests=requests,
        errors=len(errors),
        p50_ms=float(np.percentile(ms, 50)) if len(ms) else math.inf,
        p99_ms=float(np.percentile(ms, 99)) if len(ms) else math.inf,
        throughput=len(latencies) / seconds if seconds > 0 else 0.0,
        seconds=seconds,
        first_error=errors[0] if errors else "",
    )


def run(
    setup: str, url: str, body: bytes, levels: Sequence[int] = LEVELS, requests: int = 200, warmup: int = 20
) -> LoadReport:
    """Every level in turn, after `warmup` unmeasured requests (the server's first calls load
    and compile); a level gets at least 4 requests a client so each client loops."""
    run_level(url, body, 1, warmup)
    report = LoadReport(setup, url)
    for c in levels:
        report.levels.append(run_level(url, body, c, max(requests, 4 * c)))
    return report


def mlflow_body(example: dict) -> bytes:
    """An /invocations request: MLflow's serving input example as it stands."""
    return json.dumps(example).encode()


def v2_body(rows: np.ndarray, input_name: str = "input") -> bytes:
    """An Open Inference Protocol (V2) request of float32 rows, as MLServer and Triton take it.
    `input` is the name in a flyscale model's signature and its ONNX file (MLServer keys a named
    input by it; an unnamed one takes the first input, whatever its name)."""
    rows = np.asarray(rows, dtype="float32")
    tensor = {"name": input_name, "shape": list(rows.shape), "datatype": "FP32", "data": rows.ravel().tolist()}
    return json.dumps({"inputs": [tensor]}).encode()
