"""The ceiling: a grpc.aio RateLimitService that answers OK without parsing the request.

    python bench/noop.py --addr 127.0.0.1:0 [--answer bare|statuses]

Prints ``serving gRPC on ADDR (port N)`` on stderr, as fairlimit does, then serves until
SIGTERM/SIGINT. The answer is one constant serialized RateLimitResponse: ``bare`` (the
default) is {overall_code: OK} alone; ``statuses`` is what fairlimit answers the bench's hot
client on route=public (bench/bench.yaml): OK with one descriptor status, its limit (named),
remaining and reset. Behind Envoy the difference matters: with enable_x_ratelimit_headers
(examples/envoy/envoy.yaml) Envoy turns a status's limit into x-ratelimit-* headers on the
response, work a bare OK spares it. ``--spin-us N`` has each call spend N µs of the main
thread's CPU before it answers: a no-op as slow as a given server, to tell what a slower
server costs the rest of the machine (Envoy) from what it does differently.
"""

import argparse
import asyncio
import signal
import sys
import time

import grpc

RLS = "envoy.service.ratelimit.v3.RateLimitService"
OK_RESPONSE = b"\x08\x01"  # field 1 (overall_code), varint 1 (OK)


def statuses_response() -> bytes:
    """fairlimit's answer to the hot client on route=public, as one constant."""
    from wire import rls_pb2  # this checkout's protos (bench/wire.py)

    response = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)
    status = response.statuses.add(code=rls_pb2.RateLimitResponse.OK, limit_remaining=999_999)
    status.current_limit.requests_per_unit = 1_000_000
    status.current_limit.unit = status.current_limit.SECOND
    status.current_limit.name = "edge/route=public/client_id"
    status.duration_until_reset.seconds = 1
    return response.SerializeToString()


async def serve(address: str, answer: bytes = OK_RESPONSE, spin: float = 0.0) -> None:
    """Serve until SIGTERM/SIGINT; each call spends ``spin`` seconds of its thread's CPU
    first (0: none)."""

    async def should_rate_limit(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return answer

    async def spinning(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        end = time.thread_time() + spin
        while time.thread_time() < end:
            pass
        return answer

    server = grpc.aio.server()
    method = grpc.unary_unary_rpc_method_handler(spinning if spin else should_rate_limit)
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
    parser.add_argument("--answer", choices=["bare", "statuses"], default="bare",
                        help="OK alone, or with fairlimit's descriptor status (above)")
    parser.add_argument("--spin-us", type=float, default=0.0,
                        help="CPU µs each call spends first: a slower server, all else the same")
    args = parser.parse_args()
    answer = statuses_response() if args.answer == "statuses" else OK_RESPONSE
    asyncio.run(serve(args.addr, answer, args.spin_us / 1e6))


if __name__ == "__main__":
    main()
