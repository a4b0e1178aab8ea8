"""``sglang-kvpub`` and its subcommands: tail, the fan-in sidecar, the demo and its simulator, keygen, check-config."""
