"""The durable registry: stores, etcd over TLS, registrations surviving adapter restarts."""
