"""fairlimit: an Envoy-compatible rate-limit server with fair, hierarchical caps."""

__version__ = "0.1.0"
