"""open_store: the backend a URL's scheme names, or a refusal that lists the supported ones.

(The Redis URLs' own hosts and options are Redis-only, in test_redis.)
"""

import pytest

from fairlimit.errors import UnsupportedBackend
from fairlimit.store import open_store
from fairlimit.store.memory import MemoryStore

pytestmark = pytest.mark.unit

SUPPORTED = "use one of memory://, redis://, rediss://, redis+sentinel://, redis+cluster://"


class TestOpenStore:
    def test_memory_url_opens_the_in_process_store(self) -> None:
        assert isinstance(open_store("memory://"), MemoryStore)

    def test_the_scheme_is_what_precedes_the_first_separator(self) -> None:
        """Later text that looks like another URL does not choose the backend."""
        assert isinstance(open_store("memory://fallback=redis://h"), MemoryStore)

    @pytest.mark.parametrize("url", ["mongodb://x", "memory", "memory:", "://h", ""])
    def test_other_urls_are_refused_naming_every_supported_scheme(self, url: str) -> None:
        """An unknown scheme, or no scheme at all: one message, with the URL as given."""
        with pytest.raises(UnsupportedBackend) as raised:
            open_store(url)
        assert str(raised.value) == f"unknown backend URL {url!r}; {SUPPORTED}"
