"""Sockets: ZMQ frame I/O, the rank -> fan-in channel, CURVE keys, the replay client."""
