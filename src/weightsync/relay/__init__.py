"""The regional relay (``weightsync relay``): a read-only mirror of an upstream server (docs/DESIGN.md "Relays").

An edge like the service, built on it: the service's app and routes over the relay's own
catalog and store, the client SDK's wire rules toward the upstream. Nothing here is imported by
the client.
"""
