"""What `aieng serve` is configured with, beside the engine's own `EngineArgs`."""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    model_path: str = ""  # accepted as a model name too
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue_requests: int = 256
    max_queue_tokens: int = 1 << 18
    kv_cache_watermark: float = 0.95
    request_timeout: float | None = 600.0
    shutdown_timeout: float = 30.0
    max_body_bytes: int = 4 * MIB
    request_read_timeout: float | None = 30.0  # seconds a client may take for headers or body
    request_body_timeout: float | None = 30.0  # seconds a whole body may take; past it 408
    max_concurrent_body_reads: int = 64  # bodies read at once; past it 503
    max_body_reads_per_client: int | None = 16  # of those, from one peer address; past it 429
    # how long a small request holds large bodies' reads back (until its first answer); 0: off
    small_first_ms: float = 100.0
    allowed_origins: tuple[str, ...] = field(default_factory=tuple)
    log_format: str = "text"
    cost_per_hour: float | None = None  # the machine's price in USD, for the cost metrics
    model_dir: str | None = None  # versions of the served model (hot reload); see model_versions
    admin_key: str | None = None  # the admin API's key (hot reload), separate from api_key
    serve_all_versions: bool = False  # load every version of model_dir at start (name@version)
    tool_call_parser: str | None = None  # reads tool calls out of chat outputs (tool_parsers)

    def __post_init__(self) -> None:
        for name in (
            "max_queue_requests",
            "max_queue_tokens",
            "max_body_bytes",
            "max_concurrent_body_reads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.kv_cache_watermark <= 1.0:
            raise ValueError(f"kv_cache_watermark must be in (0, 1], got {self.kv_cache_watermark}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        for name in ("request_read_timeout", "request_body_timeout"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_body_reads_per_client is not None and self.max_body_reads_per_client < 1:
            raise ValueError(
                f"max_body_reads_per_client must be >= 1, got {self.max_body_reads_per_client}"
            )
        if self.small_first_ms < 0:
            raise ValueError(f"small_first_ms must be >= 0, got {self.small_first_ms}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise ValueError("admin_key must differ from api_key (API clients must not switch)")
        if self.cost_per_hour is not None and not self.cost_per_hour > 0:
            raise ValueError(f"cost_per_hour must be > 0, got {self.cost_per_hour}")
        if self.tool_call_parser is not None:
            from aieng.server.tool_parsers import tool_parser

            tool_parser(self.tool_call_parser)  # ValueError naming the known ones
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be 'text' or 'json', got {self.log_format!r}")

    def knows_model(self, name: str) -> bool:
        return name in (self.served_model_name, self.model_path)
