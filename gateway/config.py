"""The gateway's configuration: one frozen dataclass, flags > env (TESSERA_GATEWAY_*) > defaults."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.auth import TOKEN_FILE_ENV, read_token
from services.common.config import option
from services.common.tls import check_client_files

from .tenants import MIN_KEY_CHARS, Tenants, build_tenants, check_key

# Every variable the gateway reads is TESSERA_GATEWAY_<FLAG> (services/common/config.py).
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
    api_key: str | None = option(None, "if set, every /v1 request needs 'Authorization: Bearer <key>' (the admin"
                                          " endpoints take --admin-key instead); several keys are comma-separated,"
                                          " each a tenant of its own (--api-key-file groups keys into tenants)"
                                          " with its own --max-concurrent-per-key; each key at least"
                                          f" {MIN_KEY_CHARS} characters",
                                 formerly="TESSERA_API_KEY")
    api_key_file: str | None = option(None, "file of API keys and their tenants, one 'KEY TENANT' line each (several"
                                            " keys may share a tenant; mode 0600); with --api-key both sets are"
                                            " accepted, each --api-key key a tenant of its own. Each tenant's"
                                            " prefix-cache and image-cache hits are its own (--shared-cache);"
                                            f" each key at least {MIN_KEY_CHARS} characters",
                                      metavar="FILE")
    shared_cache: bool = option(False, "let every tenant share the decoder's prefix cache and the vision"
                                       " service's image cache (a single-tenant deployment with several keys);"
                                       " unset: a tenant's cached_tokens and cached_images never count another"
                                       " tenant's prompts or images")
    admin_key: str | None = option(None, "key of the admin endpoints (adapter load/unload/list): they need"
                                         " 'Authorization: Bearer <admin key>'; unset: they are disabled (403)."
                                         " /ready sent with it also gives each backend's address and state;"
                                         f" at least {MIN_KEY_CHARS} characters",
                                   formerly="TESSERA_ADMIN_KEY")
    max_body_bytes: int = option(16 * 1024 * 1024, "largest request body accepted (chat, responses and messages,"
                                                    " which may carry images); larger ones get 413")
    max_text_body_bytes: int = option(4 * 1024 * 1024, "largest body of the routes that never carry images"
                                                       " (embeddings, rerank, completions, tokenize...); 413 past it")
    max_messages: int = option(2048, "most messages (or input items) in one request, counted before the body is"
                                     " parsed; 413 past it; 0: no limit")
    max_content_parts: int = option(256, "most content parts (text, images) in one message or input item,"
                                         " counted before the body is validated; 413 past it; 0: no limit")
    grpc_timeout_s: float = option(30.0, "deadline of each backend call in seconds; past it the answer is 504")
    generate_timeout_s: float = option(600.0, "deadline of a whole generation (chat, completions) in seconds;"
                                              " past it the answer is 504, or an error event mid-stream")
    health_timeout_s: float = option(2.0, "deadline of each backend health check made by /ready, in seconds")
    model_refresh_s: float = option(10.0, "how long discovered model names are trusted before asking the"
                                          " backends' GetModelInfo again")
    # A large image's rows travel vision -> gateway -> decoder: a full-size Qwen2-VL image is ~96 MiB.
    max_message_mb: int = option(256, "largest gRPC message sent to or accepted from a backend, in MiB (image"
                                      " rows pass through: the decoder's --max-message-mb must be as large)")
    model_note: tuple[str, ...] = option((), "NAME=TEXT: shown as `note` on model NAME in /v1/models (repeatable;"
                                            " env is comma-separated), e.g. that its weights are random",
                                         metavar="NAME=TEXT")
    max_concurrent_requests: int = option(256, "most /v1 requests in flight at once (a stream counts until it"
                                               " ends); past it the answer is 429 with Retry-After; 0: no limit")
    max_concurrent_per_key: int | None = option(None, "most /v1 requests in flight at once under one API key;"
                                                      " past it that key gets 429 with Retry-After while others"
                                                      " still get through; unset: half of"
                                                      " --max-concurrent-requests when --api-key has two or more"
                                                      " keys, else none; 0: no per-key limit")
    max_tokens_per_minute_per_key: int = option(0, "most tokens (prompt + completion, as each response's usage"
                                                   " counts them) a tenant of --api-key/--api-key-file may spend a"
                                                   " minute on generation, embeddings and rerank: a token bucket"
                                                   " refilled continuously; a request that finds it empty gets 429"
                                                   " with Retry-After, and what a request spends is debited when it"
                                                   " ends, so one may overdraw it; no API key: all callers share one"
                                                   " bucket; 0: no limit")
    send_timeout_s: float = option(30.0, "a response that waits this many seconds to send because its client"
                                         " does not read (it must take ~48 KiB of the 64 KiB the gateway buffers"
                                         " per connection) is cut, freeing its place and cancelling its"
                                         " generation; 0: never")
    tls_ca: str | None = option(None, "PEM CA: talk TLS to every backend and trust only servers it signed",
                                metavar="FILE")
    tls_client_cert: str | None = option(None, "PEM certificate sent to the backends (mutual TLS; needs"
                                               " --tls-ca and --tls-client-key)", metavar="FILE")
    tls_client_key: str | None = option(None, "PEM private key of --tls-client-cert", metavar="FILE")
    tls_server_name: str | None = option(None, "name to verify in the backends' certificates instead of the"
                                               " host of each address", metavar="NAME")
    backend_token_file: str | None = option(None, "file holding the fleet's backend token, sent with every"
                                                  " backend call (the services' --backend-token-file)",
                                            env=TOKEN_FILE_ENV, metavar="FILE")
    trace_requests: bool = option(False, "answer a request sent with 'x-tessera-trace: 1' with an x-tessera-trace"
                                         " header of its stage timestamps (benchmarks: bench/pooling.py)")
    response_store: str | None = option(None, "Redis URL (redis://HOST:PORT/DB) where /v1/responses keeps stored"
                                              " responses (store, previous_response_id, GET/DELETE by id);"
                                              " unset: store true is refused", metavar="URL")
    response_store_ttl_s: int = option(3600, "how long a stored response is kept, in seconds")
    response_store_max_bytes: int = option(64 * 1024 * 1024, "most bytes of stored responses per tenant; past"
                                                             " it the tenant's oldest are evicted")
    log_level: str = option("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The API keys (--api-key split at commas, stripped); empty: no authentication."""
        return tuple(key.strip() for key in self.api_key.split(",")) if self.api_key is not None else ()

    def tenants(self, quiet: bool = False) -> Tenants:
        """Every accepted key and its tenant (reads --api-key-file); no keys: no authentication."""
        return build_tenants(self.api_keys, self.api_key_file, self.shared_cache, quiet)

    @property
    def notes(self) -> dict[str, str]:
        """model name -> its --model-note text."""
        return dict(note.split("=", 1) for note in self.model_note)

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
        if self.api_key is not None and any(not key.strip() for key in self.api_key.split(",")):
            raise ValueError("api_key must not be empty, nor have an empty key between commas (leave it unset to"
                             " disable authentication)")
        if len(set(self.api_keys)) != len(self.api_keys):
            raise ValueError("api_key: each key must be given once")
        if self.admin_key == "":
            raise ValueError("admin_key must not be empty (leave it unset to disable the admin endpoints)")
        if self.admin_key is not None:
            check_key(self.admin_key.strip(), "--admin-key")
        keys = self.tenants(quiet=True).keys   # reads and checks --api-key-file (create_app warns)
        if self.admin_key is not None and self.admin_key.strip() in keys:
            # Every API caller would be an admin; the point of a separate key is that they are not.
            raise ValueError("admin_key must differ from every api_key (and every key of api_key_file)")
        if self.max_body_bytes < 1024 or self.max_text_body_bytes < 1024:
            raise ValueError("max_body_bytes and max_text_body_bytes must be at least 1024")
        if self.max_messages < 0 or self.max_content_parts < 0:
            raise ValueError("max_messages and max_content_parts must be >= 0 (0: no limit)")
        for name in ("grpc_timeout_s", "generate_timeout_s", "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.model_refresh_s < 0:
            raise ValueError("model_refresh_s must be >= 0")
        if self.max_message_mb < 1:
            raise ValueError("max_message_mb must be at least 1")
        for note in self.model_note:
            name, sep, text = note.partition("=")
            if not (sep and name.strip() and text.strip()):
                raise ValueError(f"model_note: {note!r} is not NAME=TEXT")
        if self.max_concurrent_requests < 0:
            raise ValueError("max_concurrent_requests must be >= 0 (0: no limit)")
        if self.max_concurrent_per_key is not None and self.max_concurrent_per_key < 0:
            raise ValueError("max_concurrent_per_key must be >= 0 (0: no per-key limit)")
        if self.max_tokens_per_minute_per_key < 0:
            raise ValueError("max_tokens_per_minute_per_key must be >= 0 (0: no limit)")
        if self.send_timeout_s < 0:
            raise ValueError("send_timeout_s must be >= 0 (0: never)")
        if self.response_store_ttl_s < 1 or self.response_store_max_bytes < 1024:
            raise ValueError("response_store_ttl_s must be >= 1 and response_store_max_bytes >= 1024")
        if self.tls_server_name is not None and self.tls_ca is None:
            raise ValueError("tls_server_name needs tls_ca")
        check_client_files(self.tls_ca, self.tls_client_cert, self.tls_client_key)
        if self.backend_token_file is not None:
            read_token(self.backend_token_file)
