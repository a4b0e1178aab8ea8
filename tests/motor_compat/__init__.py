"""Motor against the adapter: configs, contracts, registrations, the real coordinator, kv-conductor's entry."""
