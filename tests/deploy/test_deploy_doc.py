"""The deployment guide (docs/deployment.md): no name left to guess, no path that is not there."""

import re

import pytest

from .helpers import ROOT, Helm

pytestmark = pytest.mark.unit

GUIDE = ROOT / "docs" / "deployment.md"


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
