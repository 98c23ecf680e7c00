"""What every tessera service shares: protos, tensor codec, errors, config, server, metrics."""
