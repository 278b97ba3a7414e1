"""Messages whose descriptor values are not all UTF-8, read anyway.

proto3 string fields must hold UTF-8, and protobuf refuses a message that breaks that
(DecodeError). Envoy copies a header's bytes into a descriptor's value (and into an RLQS
bucket id) as they came, and HTTP/1.1 lets a header carry any byte but controls: one byte
0xFF in ``x-client-id`` made the rate-limit call fail, and Envoy let the request through
(``failure_mode_allowed``), every time; in an RLQS report it ended the stream of every
bucket of that Envoy. So bytes that do not parse are read a second time as the same
messages with ``bytes`` where they have ``string`` (the wire format is the same); each
value that is no UTF-8 is replaced by its stand-in (core/values.py), and the result is
parsed as the real message. Keys and domains come from Envoy's configuration: those must be
UTF-8 still.

A message that parses is parsed once, as the real message, and nothing more.
"""

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.values import stand_in


def _as_bytes(message: descriptor_pb2.DescriptorProto, renamed: dict[str, str]) -> set[str]:
    """Turn ``message``'s string fields (its nested messages' too) into bytes, point its
    references to mirrored messages at the mirrors, and drop options (a map becomes the
    repeated entries it is on the wire); the type names it still refers to elsewhere."""
    outside: set[str] = set()
    message.ClearField("options")
    for field in message.field:
        field.ClearField("options")
        field.ClearField("json_name")
        if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
            field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
        if field.type_name:
            original = field.type_name
            prefix = next((p for p in renamed if original == p or original.startswith(p + ".")),
                          None)  # fmt: skip
            if prefix is None:
                outside.add(original.lstrip("."))
            else:
                field.type_name = renamed[prefix] + original[len(prefix) :]
    for nested in message.nested_type:
        outside |= _as_bytes(nested, renamed)
    for enum in message.enum_type:
        enum.ClearField("options")
    return outside


def _mirror(name: str, originals: tuple[Any, ...]) -> type[Message]:
    """The first of ``originals`` (message descriptors: upb's, typed apart from Python's)
    with bytes for strings, in a package of its own in the default pool, the others being
    the messages it holds."""
    pool = descriptor_pool.Default()
    package = f"fairlimit.lenient.{name}"
    file = descriptor_pb2.FileDescriptorProto(
        name=f"fairlimit/lenient_{name}.proto", package=package, syntax="proto3"
    )
    renamed = {f".{d.full_name}": f".{package}.{d.name}" for d in originals}
    outside: set[str] = set()
    for original in originals:
        message = file.message_type.add()
        original.CopyToProto(message)
        outside |= _as_bytes(message, renamed)
    files = set()
    for type_name in outside:
        try:
            files.add(pool.FindMessageTypeByName(type_name).file.name)
        except KeyError:
            files.add(pool.FindEnumTypeByName(type_name).file.name)
    file.dependency.extend(sorted(files))
    pool.Add(file)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"{package}.{originals[0].name}")
    )


_Request = _mirror(
    "rls", (rls_pb2.RateLimitRequest.DESCRIPTOR, ratelimit_pb2.RateLimitDescriptor.DESCRIPTOR)
)
_BucketId = _mirror("rlqs", (rlqs_pb2.BucketId.DESCRIPTOR,))


def _mend(entries: Iterable[Any]) -> None:
    """Replace each entry's value that is no UTF-8 by its stand-in."""
    for entry in entries:
        try:
            entry.value.decode("utf-8")
        except UnicodeDecodeError:
            entry.value = stand_in(entry.value).encode("utf-8")


_M = TypeVar("_M", bound=Message)


def _parse(real: type[_M], mirror: type[Message], payload: bytes,
           entries: Callable[[Any], Iterable[Any]]) -> tuple[_M, bool]:  # fmt: skip
    """``payload`` as ``real``, and whether it read as it was; if it does not parse, read
    again through ``mirror`` with each of its ``entries``' values that is no UTF-8 replaced
    by its stand-in. DecodeError, protobuf's first one, when it does not parse even so."""
    try:
        return real.FromString(payload), True
    except DecodeError as exc:
        try:
            message = mirror.FromString(payload)
            _mend(entries(message))
            return real.FromString(message.SerializeToString()), False
        except DecodeError:
            raise exc from None


def request(payload: bytes) -> rls_pb2.RateLimitRequest:
    """The RateLimitRequest in ``payload``, each descriptor value that is no UTF-8 replaced
    by its stand-in; DecodeError when it is no RateLimitRequest even so."""

    def entries(message: Any) -> Iterable[Any]:
        return (entry for descriptor in message.descriptors for entry in descriptor.entries)

    return _parse(rls_pb2.RateLimitRequest, _Request, payload, entries)[0]


def bucket_id(payload: bytes) -> tuple[rlqs_pb2.BucketId, bool]:
    """The RLQS BucketId in ``payload``, each value that is no UTF-8 replaced by its
    stand-in, and whether it was all UTF-8 (Envoy reads back only such an id); DecodeError
    when it is no BucketId even so."""
    return _parse(rlqs_pb2.BucketId, _BucketId, payload, lambda message: message.bucket)
