"""The gRPC side: the DecoderService, its config, request mapping, the engine thread and adapter admin."""
