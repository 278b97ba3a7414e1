"""Envoy's rate-limit messages and service stub, public: call fairlimit from Python.

The generated code lives in the private ``fairlimit._proto`` (its layout follows the protos
and may change); these are the names a client needs, kept stable here. A usage sketch is
in docs/getting-started.md ("One call by hand").
"""

from fairlimit._proto.envoy.extensions.common.ratelimit.v3.ratelimit_pb2 import (
    RateLimitDescriptor,
)
from fairlimit._proto.envoy.service.ratelimit.v3.rls_pb2 import (
    RateLimitRequest,
    RateLimitResponse,
)
from fairlimit._proto.envoy.service.ratelimit.v3.rls_pb2_grpc import RateLimitServiceStub

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"  # the gRPC service's full name

__all__ = [
    "SERVICE",
    "RateLimitDescriptor",
    "RateLimitRequest",
    "RateLimitResponse",
    "RateLimitServiceStub",
]
