"""A stand-in LLM API for trying examples/envoy/llm-tokens.yaml (docs/tokens.md).

    python3 examples/llm/stand-in-llm.py            # 127.0.0.1:8000
    python3 examples/llm/stand-in-llm.py --port 0   # a free port, printed on stdout

Standard library only. It answers any GET or POST like an OpenAI-style chat completion
and reports the tokens it "used" the way OpenAI's API does, so that Envoy can settle each
reservation:

- a plain answer: a JSON body with ``usage.total_tokens`` (no ``x-tokens-used`` header,
  as OpenAI's API sends none);
- a stream (``"stream": true`` in a JSON body, or ``x-simulated-stream: sse``): server-sent
  events, the usage in the last event before ``data: [DONE]`` (as OpenAI sends it with
  ``stream_options.include_usage``), no ``x-tokens-used`` header;
- ``x-simulated-stream: trailer``: a chunked body with the usage in an ``x-tokens-used``
  trailer.

Request headers drive it:

- ``x-simulated-tokens: N``: the tokens used (default 100);
- ``x-simulated-failure``: ``500``, ``503`` or ``429`` answer that status with no usage (the
  provider failed, or refused with its own rate limit); ``reset`` closes the connection
  without answering; ``slow`` answers after ``x-simulated-delay`` seconds (default 5), so
  that a route timeout answers first.
"""

import argparse
import json
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEFAULT_TOKENS = 100
WORDS = ("The", " stand-in", " says", " hello", ".")


class StandIn(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked bodies and trailers

    def do_GET(self) -> None:
        self._answer(b"")

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self._answer(self.rfile.read(length))

    def _answer(self, body: bytes) -> None:
        used = int(self.headers.get("x-simulated-tokens") or DEFAULT_TOKENS)
        failure = self.headers.get("x-simulated-failure", "")
        if failure == "reset":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if failure == "slow":
            time.sleep(float(self.headers.get("x-simulated-delay") or 5))
        elif failure:
            self._send(int(failure), {"error": {"message": f"simulated {failure}"}})
            return
        stream = self.headers.get("x-simulated-stream", "")
        if not stream and body:
            try:
                stream = "sse" if json.loads(body).get("stream") is True else ""
            except (ValueError, AttributeError):
                stream = ""
        if stream:
            self._stream(used, trailer=stream == "trailer")
        else:
            self._send(200, _completion(used))

    def _send(self, status: int, payload: dict[str, object]) -> None:
        data = json.dumps(payload).encode() + b"\n"
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, used: int, trailer: bool) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        if trailer:
            self.send_header("trailer", "x-tokens-used")
        self.end_headers()
        for word in WORDS:
            self._chunk(_event({"choices": [{"index": 0, "delta": {"content": word}}]}))
        if not trailer:
            self._chunk(_event({"choices": [], "usage": _usage(used)}))
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n")
        if trailer:
            self.wfile.write(f"x-tokens-used: {used}\r\n".encode())
        self.wfile.write(b"\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:
        pass


def _usage(used: int) -> dict[str, int]:
    prompt = min(used, 10)
    return {"prompt_tokens": prompt, "completion_tokens": used - prompt, "total_tokens": used}


def _completion(used: int) -> dict[str, object]:
    message = {"role": "assistant", "content": "".join(WORDS)}
    return {"object": "chat.completion", "choices": [{"index": 0, "message": message}],
            "usage": _usage(used)}  # fmt: skip


def _event(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps({"object": "chat.completion.chunk", **payload}).encode() + b"\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    port = parser.parse_args().port
    ThreadingHTTPServer.request_queue_size = 128  # many requests at once (5 by default)
    server = ThreadingHTTPServer(("127.0.0.1", port), StandIn)
    server.daemon_threads = True
    print(f"stand-in LLM on 127.0.0.1:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
