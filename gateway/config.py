"""The gateway's configuration: one frozen dataclass, flags > env (TESSERA_GATEWAY_*) > defaults."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.config import option

ENV_PREFIX = "TESSERA_GATEWAY_"


def _check_address(flag: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: {address!r} is not HOST:PORT")


@dataclass(frozen=True)
class GatewayConfig:
    """Gateway options"""

    host: str = option("0.0.0.0", "address to bind the HTTP server")
    port: int = option(8000, "HTTP port")
    pooling: str | None = option(None, "pooling service (embeddings, rerank) as HOST:PORT", metavar="HOST:PORT")
    decoder: tuple[str, ...] = option((), "decoder service replica as HOST:PORT (repeatable; env is comma-separated);"
                                          " checked by /ready", metavar="HOST:PORT")
    vision: str | None = option(None, "vision service as HOST:PORT; checked by /ready", metavar="HOST:PORT")
    api_key: str | None = option(None, "if set, every /v1 request needs 'Authorization: Bearer <key>'",
                                 env="TESSERA_API_KEY")
    max_body_bytes: int = option(16 * 1024 * 1024, "largest request body accepted; larger ones get 413")
    grpc_timeout_s: float = option(30.0, "deadline of each backend call in seconds; past it the answer is 504")
    generate_timeout_s: float = option(600.0, "deadline of a whole generation (chat, completions) in seconds;"
                                              " past it the answer is 504, or an error event mid-stream")
    health_timeout_s: float = option(2.0, "deadline of each backend health check made by /ready, in seconds")
    model_refresh_s: float = option(10.0, "how long discovered model names are trusted before asking the"
                                          " backends' GetModelInfo again")
    # A large image's rows travel vision -> gateway -> decoder: a full-size Qwen2-VL image is ~96 MiB.
    max_message_mb: int = option(256, "largest gRPC message sent to or accepted from a backend, in MiB (image"
                                      " rows pass through: the decoder's --max-message-mb must be as large)")
    max_images_per_request: int = option(8, "most image_url parts in one chat request; more get 400")
    max_image_bytes: int = option(10 * 2**20, "largest decoded image in an image_url data URI, in bytes; larger"
                                              " ones get 413 (the body is bounded by --max-body-bytes too)")
    log_level: str = option("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535")
        for flag, addresses in (("pooling", [self.pooling]), ("vision", [self.vision]),
                                ("decoder", list(self.decoder))):
            for address in addresses:
                if address is not None:
                    _check_address(flag, address)
        if not (self.pooling or self.decoder or self.vision):
            raise ValueError("configure at least one backend: --pooling, --decoder or --vision")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset to disable authentication)")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        for name in ("grpc_timeout_s", "generate_timeout_s", "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.model_refresh_s < 0:
            raise ValueError("model_refresh_s must be >= 0")
        if self.max_message_mb < 1:
            raise ValueError("max_message_mb must be at least 1")
        if self.max_images_per_request < 1 or self.max_image_bytes < 1:
            raise ValueError("max_images_per_request and max_image_bytes must be at least 1")
