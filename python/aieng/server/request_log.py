"""One log line per finished request, as `key=value` text or as a JSON object."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass

logger = logging.getLogger("aieng.server.requests")


@dataclass
class RequestRecord:
    request_id: str
    endpoint: str
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    engine_s: float | None = None  # its share of the engine's step time
    cost_usd: float | None = None  # engine_s at --cost-per-hour
    stages: str | None = None  # at debug level: seconds in each stage (see server.stages)
    arrival: float | None = None  # at debug level: its arrival, time.monotonic() (this machine's)
    # at debug level: the smallest token budget of the steps that first scheduled its prompts
    # (below max_num_batched_tokens when clients shared the engine: shared_step_ms)
    step_budget: int | None = None


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": "request finished" if fields is not None else record.getMessage(),
        }
        if fields is not None:
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(log_format: str, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("aieng")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def debug_stages() -> bool:
    """Whether request lines carry their stage times (the log is at debug level)."""
    return logger.isEnabledFor(logging.DEBUG)


def log_request(record: RequestRecord) -> None:
    fields = {k: _rounded(v) for k, v in asdict(record).items()}
    text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    logger.info(text, extra={"fields": fields})


def _rounded(value: object) -> object:
    return round(value, 6) if isinstance(value, float) else value
