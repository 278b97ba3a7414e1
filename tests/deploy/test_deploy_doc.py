"""The deployment guide (docs/deployment.md): no name left to guess, no path that is not there."""

import re

import pytest

from .helpers import DOCKERFILE, ROOT, Helm
from .image import BASE_IMAGE, BUILD, CA_BUNDLE, EG_UID, MMDEBSTRAP

pytestmark = pytest.mark.unit

GUIDE = ROOT / "docs" / "deployment.md"


def flat(text: str) -> str:
    """Shell text with its line continuations joined and all whitespace runs one space."""
    return " ".join(text.replace("\\\n", " ").split())


class TestDeployDoc:
    def test_names_every_resource_the_walkthrough_creates(self, helm: Helm) -> None:
        """Each resource of the install with istio.enabled, and the Istio cluster, is named."""
        text = GUIDE.read_text()
        docs = helm.template({"istio": {"enabled": True}})
        for doc in docs:
            meta = doc["metadata"]
            assert f"`{meta['name']}`" in text, f"{doc['kind']} {meta['name']}"
            assert f"namespace `{meta['namespace']}`" in text, meta["namespace"]
        assert "outbound|8081||fairlimit.fairlimit.svc.cluster.local" in text
        assert "helm install fairlimit ./helm/fairlimit -n fairlimit --create-namespace" in text

    def test_files_it_mentions_exist(self) -> None:
        """Every repository path the guide points to is there."""
        paths = set(re.findall(r"(?:examples|helm|docs)/[\w./-]+\w", GUIDE.read_text()))
        assert paths, "no paths found"
        assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []

    def test_podman_commands_are_the_ones_the_image_test_runs(self) -> None:
        """The guide and the Dockerfile's header build as tests/deploy/test_image.py does."""
        guide = GUIDE.read_text()
        lines = DOCKERFILE.read_text().splitlines()
        header = flat("\n".join(line.lstrip("#") for line in lines if line.startswith("#")))
        commands = flat(guide)
        for text in (commands, header):
            assert " ".join([*MMDEBSTRAP[:-2], MMDEBSTRAP[-1]]) + " " in text
            assert f"podman import /tmp/debian-bookworm.tar {BASE_IMAGE}" in text
            assert "podman " + " ".join(BUILD) in text
            assert f"-v {CA_BUNDLE}:{CA_BUNDLE}:ro" in text
            assert f"--build-arg PYTHON_IMAGE={BASE_IMAGE}" in text
        assert f'chroot --userspec={EG_UID}:{EG_UID} "$root" /bin/ratelimit' in guide
