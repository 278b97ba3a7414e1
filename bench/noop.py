"""The ceiling: a grpc.aio RateLimitService that answers OK without parsing the request.

    python bench/noop.py --addr 127.0.0.1:0

Prints ``serving gRPC on ADDR (port N)`` on stderr, as fairlimit does, then serves until
SIGTERM/SIGINT. The answer is one constant serialized RateLimitResponse{overall_code: OK}.
"""

import argparse
import asyncio
import signal
import sys

import grpc

RLS = "envoy.service.ratelimit.v3.RateLimitService"
OK_RESPONSE = b"\x08\x01"  # field 1 (overall_code), varint 1 (OK)


async def _should_rate_limit(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return OK_RESPONSE


async def serve(address: str) -> None:
    server = grpc.aio.server()
    method = grpc.unary_unary_rpc_method_handler(_should_rate_limit)  # bytes in, bytes out
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(RLS, {"ShouldRateLimit": method}),)
    )
    port = server.add_insecure_port(address)
    await server.start()
    print(f"serving gRPC on {address} (port {port})", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="127.0.0.1:0")
    asyncio.run(serve(parser.parse_args().addr))


if __name__ == "__main__":
    main()
