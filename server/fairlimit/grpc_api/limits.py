"""How much a gRPC client may make the server hold: the receive limit and the call cap."""

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit._proto.envoy.type.v3 import ratelimit_unit_pb2
from fairlimit.core.request import MAX_DESCRIPTORS, MAX_ENTRIES, MAX_HITS, MAX_TEXT

D = ratelimit_pb2.RateLimitDescriptor


def largest_request() -> int:
    """The encoded size of the largest RateLimitRequest the request bounds admit (in ASCII
    text: 2,108,809 bytes). A larger message cannot be valid, so grpc may refuse it unread."""
    text = "x" * MAX_TEXT
    entry = D.Entry(key=text, value=text)
    override = D.RateLimitOverride(
        requests_per_unit=0xFFFFFFFF, unit=ratelimit_unit_pb2.RateLimitUnit.YEAR
    )
    descriptor = D(entries=[entry] * MAX_ENTRIES, limit=override)
    descriptor.hits_addend.value = MAX_HITS
    request = rls_pb2.RateLimitRequest(
        domain=text, descriptors=[descriptor] * MAX_DESCRIPTORS, hits_addend=MAX_HITS
    )
    return request.ByteSize()


def server_options(max_receive: int) -> list[tuple[str, int]]:
    """grpc options that bound what unread calls hold.

    Beyond the receive limit grpc answers RESOURCE_EXHAUSTED without reading the message
    (it used to be grpc's 4 MB, and a 3.9 MB request was parsed whole before the request
    bounds rejected it). Without BDP probing a stream's window stays at 64 KB, so a call
    waiting for its turn holds that much rather than its whole message: with the cap on
    concurrent calls, a flood of large requests costs about cap x receive limit.
    """
    return [
        ("grpc.max_receive_message_length", max_receive or largest_request()),
        ("grpc.http2.bdp_probe", 0),
    ]
