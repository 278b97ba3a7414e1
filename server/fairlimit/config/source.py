"""Where the running config comes from: one interface over the files and xDS.

As envoyproxy/ratelimit's config providers: a source hands every config it loads to
``apply`` (or the ConfigError to ``reject``, and the running config stays) until ``stop``.
The files (``config/watch.py``) have a config at start and reload on change or SIGHUP; an
xDS management server (``grpc_api/xds.py``) sends the first one when it will and pushes
every change itself. The app holds one source and does not ask which.

A config that limits nothing is refused from fairlimit's own ``--config`` files (unless
``--allow-empty-config``): there an emptied directory is far more often a mistake, and
``empty_problems`` says why. From xDS (and under upstream's ``RUNTIME_*`` layout) it is a
valid state, as upstream takes it: Envoy Gateway pushes an empty snapshot when a Gateway has
no rate-limit policy, none yet or the last one deleted; it is applied, and logged.
"""

import asyncio
from collections.abc import Callable
from typing import Protocol

from fairlimit.core.rules import Config, Loaded, walk
from fairlimit.errors import ConfigError

Apply = Callable[[Loaded], None]
Reject = Callable[[ConfigError], None]

ALLOW = "a config without limits turns the limiter off; --allow-empty-config accepts it"


class ConfigSource(Protocol):
    """A source of configs (the files, or an xDS management server)."""

    @property
    def name(self) -> str:
        """Where the configs come from, for log lines."""
        ...

    @property
    def applied(self) -> asyncio.Event:
        """Set once a config was applied (by the files, at start)."""
        ...

    def initial(self) -> Loaded | None:
        """The config to start with (ConfigError when it is refused); None when there is
        none until the source sends one."""
        ...

    async def run(self) -> None:
        """Apply every new config, until ``stop``."""
        ...

    async def reload(self) -> bool:
        """Load again now (SIGHUP); True when a new config was applied."""
        ...

    def stop(self) -> None: ...


def limits_nothing(config: Config) -> bool:
    """No rate limit (other than ``unlimited``) and no concurrency limit in any domain."""
    return not any(
        (rule.rate_limit is not None and not rule.rate_limit.unlimited) or rule.concurrency
        for domain in config.domains.values()
        for rule, _ in walk(domain.rules)
    )


def empty_problems(config: Config, where: str) -> list[str]:
    """Why ``config``, sent by ``where``, would switch limiting off (nothing: none)."""
    if not limits_nothing(config):
        return []
    return [f"{where}: (config): no rate limit in any domain: {ALLOW}"]
