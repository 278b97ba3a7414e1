"""One call by hand, as the docs show it: POST /json with curl, grpcurl through the server's
reflection, and the public Python stubs (fairlimit.grpc_api.rls), each run against a real
server as written in README.md and docs/getting-started.md (issue 37)."""

import json
import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from servers import ROOT, ServerProcess, fairlimit_server

pytestmark = pytest.mark.process

GUIDE = ROOT / "docs" / "getting-started.md"
QUICKSTART = ROOT / "examples" / "envoy" / "descriptors" / "quickstart.yaml"


def section(heading: str) -> str:
    text = GUIDE.read_text()
    start = text.index(heading)
    return text[start : text.index("\n## ", start + 1)]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def command(block: str, program: str) -> list[str]:
    """The words of a shell block holding one ``program`` command (and comments), as the
    shell reads them: a quote spans lines, a backslash continues one."""
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    assert words[0] == program, block
    return words


def post_json(port: int, body: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/json", body.encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return int(answer.status), json.loads(answer.read())


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The quick start's descriptors: 10 a minute per client_id under route=public."""
    with fairlimit_server("--config", str(QUICKSTART)) as process:
        yield process


class TestOneCallByHand:
    def test_the_curl_line_posts_one_call(self, server: ServerProcess) -> None:
        """getting-started.md's curl: 200 and the JSON its comment shows (a fresh client)."""
        (block, *_) = blocks(section("## One call by hand"), "sh")
        words = command(block, "curl")
        body = words[words.index("-d") + 1].replace("carol", "curl-client")
        status, answer = post_json(server.admin_port, body)
        assert status == 200
        assert answer["overallCode"] == "OK"
        (shown,) = answer["statuses"]
        assert shown["currentLimit"] == {
            "requestsPerUnit": 10, "unit": "MINUTE", "name": "edge/route=public/client_id"
        }  # fmt: skip
        assert shown["limitRemaining"] == 9

    def test_grpcurl_has_what_it_needs_from_reflection(self, server: ServerProcess) -> None:
        """What grpcurl does with the documented line, by a real reflection client: find
        the method by name, build its request from the -d JSON with the reflected
        descriptors only (no generated code), call it."""
        (_, block, *_) = blocks(section("## One call by hand"), "sh")
        words = command(block, "grpcurl")
        assert words[:2] == ["grpcurl", "-plaintext"] and words[-2] == "127.0.0.1:8081"
        service_name, method_name = words[-1].split("/")
        body = words[words.index("-d") + 1].replace("carol", "grpcurl-client")
        with grpc.insecure_channel(server.target) as channel:
            pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
            method = pool.FindServiceByName(service_name).FindMethodByName(method_name)
            asked = message_factory.GetMessageClass(method.input_type)
            answered = message_factory.GetMessageClass(method.output_type)
            call = channel.unary_unary(
                f"/{service_name}/{method_name}",
                request_serializer=asked.SerializeToString,
                response_deserializer=answered.FromString,
            )
            answer = call(json_format.Parse(body, asked()), timeout=5)
        shown = json_format.MessageToDict(answer)
        assert shown["overallCode"] == "OK" and shown["statuses"][0]["limitRemaining"] == 9

    def test_the_python_snippet_runs_on_the_public_module(self, server: ServerProcess) -> None:
        """The documented snippet, run as written (address and client swapped): OK 9."""
        (snippet,) = blocks(section("## One call by hand"), "python")
        assert "fairlimit._proto" not in snippet
        code = snippet.replace("127.0.0.1:8081", server.target).replace("carol", "py-client")
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
            env={"PYTHONPATH": str(ROOT / "server")}, check=False,
        )  # fmt: skip
        assert (out.returncode, out.stdout) == (0, "OK 9\n"), out.stderr


class TestReadme:
    def test_the_readmes_json_call_on_the_quick_starts_server(self) -> None:
        """README's POST /json, against the quick start's `fairlimit serve`: OK, 10 a minute."""
        text = " ".join((ROOT / "README.md").read_text().split())
        found = re.search(r"`(curl -s -X POST http://127\.0\.0\.1:8080/json -d '[^']*')`", text)
        assert found is not None
        body = shlex.split(found.group(1))[-1]
        with fairlimit_server("--config", str(QUICKSTART)) as process:
            status, answer = post_json(process.admin_port, body)
        assert status == 200 and answer["overallCode"] == "OK"
        assert answer["statuses"][0]["currentLimit"]["requestsPerUnit"] == 10
        assert answer["statuses"][0]["limitRemaining"] == 9
