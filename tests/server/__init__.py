"""The real-server test tier (marker ``server``)."""
