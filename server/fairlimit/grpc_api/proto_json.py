"""RateLimitRequest and RateLimitResponse in proto3 JSON, for the admin ``POST /json``."""

from google.protobuf import json_format

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.request import Request
from fairlimit.errors import RequestError
from fairlimit.grpc_api.convert import request_from_proto, response_to_proto
from fairlimit.grpc_api.headers import ResponseOptions, add_extras
from fairlimit.limiter import Decision


def request_from_json(body: bytes | str) -> Request:
    """A RateLimitRequest in proto3 JSON as the core sees it; RequestError when unusable."""
    try:
        message = json_format.Parse(body, rls_pb2.RateLimitRequest())
    except (json_format.ParseError, UnicodeDecodeError) as exc:
        raise RequestError(f"not a RateLimitRequest in proto3 JSON: {exc}") from exc
    return request_from_proto(message)


def response_to_json(
    decision: Decision, body: bytes | str = b"", options: ResponseOptions | None = None
) -> str:
    """The RateLimitResponse Envoy would get for the request ``body``, in proto3 JSON."""
    response = response_to_proto(decision, options is not None and options.rule_names)
    if options is not None and options.any:
        request = json_format.Parse(body, rls_pb2.RateLimitRequest())  # parsed once already
        add_extras(response, request, decision.statuses, options)
    return json_format.MessageToJson(response, indent=None)
