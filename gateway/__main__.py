"""python -m gateway --port P [--pooling HOST:PORT] [--decoder HOST:PORT]... [--vision HOST:PORT]"""
from __future__ import annotations

import uvicorn

from services.common import logs
from services.common.config import load, log_config

from .app import HTTP_PARSER, create_app
from .config import ENV_PREFIX, GatewayConfig

DESCRIPTION = ("tessera's OpenAI-compatible HTTP gateway: /v1/chat/completions, /v1/completions, /v1/embeddings, "
               "/v1/rerank (/rerank, /v2/rerank), "
               "/v1/models, /health, /ready, /metrics, /openapi.json, and the admin adapter endpoints "
               "/v1/load_lora_adapter, /v1/unload_lora_adapter, /v1/lora_adapters, in front of the gRPC services.")


def main(argv=None) -> None:
    (cfg,) = load((GatewayConfig,), argv, prog="python -m gateway", description=DESCRIPTION,
                  env_prefix=ENV_PREFIX)
    logs.setup(cfg.log_level)
    log_config(cfg, hidden=("api_key", "admin_key"))   # the keys themselves never reach a log
    # Our edge middleware logs each request with its id, so uvicorn's access log is off.
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level=cfg.log_level.lower(), http=HTTP_PARSER,
                access_log=False, log_config=None)


if __name__ == "__main__":
    main()
