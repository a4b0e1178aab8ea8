"""The publishing side of the instance stream: rank publishers, the fan-in, replay and snapshot."""
