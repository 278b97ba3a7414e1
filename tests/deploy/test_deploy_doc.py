"""The deployment guide: no name left to guess, no path that is not there."""

import re

from .helpers import ROOT, Helm

README = ROOT / "README.md"


def deploy_section() -> str:
    """The README from its "## Deploy" heading to the next second-level heading."""
    text = README.read_text()
    start = text.index("\n## Deploy\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


class TestDeployDoc:
    """The README's Deploy section: no name left to guess."""

    def test_names_every_resource_the_walkthrough_creates(self, helm: Helm) -> None:
        """Each resource of the install with istio.enabled, and the Istio cluster, is named."""
        text = deploy_section()
        docs = helm.template({"istio": {"enabled": True}})
        for doc in docs:
            meta = doc["metadata"]
            assert f"`{meta['name']}`" in text, f"{doc['kind']} {meta['name']}"
            assert f"namespace `{meta['namespace']}`" in text, meta["namespace"]
        assert "outbound|8081||fairlimit.fairlimit.svc.cluster.local" in text
        assert "helm install fairlimit ./helm/fairlimit -n fairlimit --create-namespace" in text

    def test_files_it_mentions_exist(self) -> None:
        """Every repository path the section points to is there."""
        text = deploy_section()
        paths = set(re.findall(r"(?:examples|helm|docs)/[\w./-]+\w", text))
        assert paths, "no paths found"
        assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []
