"""Token-budget instruments: hits reserved, given back and charged as debt, per rule, and
the stream-done calls that paired with no reservation, and the reservations refused because
their request id still held an open one.

Attributes are ``domain`` ("" for a negative-hits descriptor of a domain the config does
not have) and ``rule`` (the reserving rule's path; "" for a negative-hits descriptor that
matched no rule); never a client value or a request id.
"""

from collections.abc import Callable

from opentelemetry.metrics import Meter

from fairlimit.core.reserve import Settled


class TokenInstruments:
    """The token-budget instruments; recording failures go to ``failed``."""

    def __init__(self, meter: Meter, failed: Callable[[], None]) -> None:
        self._failed = failed
        self._reserved = meter.create_counter(
            "fairlimit.tokens.reserved", "{hit}", "Hits reserved by admitted requests"
        )
        self._refunded = meter.create_counter(
            "fairlimit.tokens.refunded", "{hit}", "Reserved hits given back at settlement"
        )
        self._debt = meter.create_counter(
            "fairlimit.tokens.debt",
            "{hit}",
            "Hits charged at settlement above what was reserved, even over the limit",
        )
        self._unpaired = meter.create_counter(
            "fairlimit.tokens.unpaired",
            "{descriptor}",
            "Settlements and negative hits that found no open reservation: nothing changed",
        )
        self._open = meter.create_counter(
            "fairlimit.tokens.id_open",
            "{request}",
            "Reservations refused because their request id still held an open one",
        )

    def reserved(self, domain: str, rule: str, hits: int) -> None:
        try:
            self._reserved.add(hits, {"domain": domain, "rule": rule})
        except Exception:
            self._failed()

    def id_open(self, domain: str, rules: list[str]) -> None:
        try:
            for rule in rules:
                self._open.add(1, {"domain": domain, "rule": rule})
        except Exception:
            self._failed()

    def settled(self, domain: str, rule: str, settled: Settled) -> None:
        try:
            attributes = {"domain": domain, "rule": rule}
            if not settled.found:
                self._unpaired.add(1, attributes)
                return
            if settled.refund:
                self._refunded.add(settled.refund, attributes)
            if settled.debt:
                self._debt.add(settled.debt, attributes)
        except Exception:
            self._failed()
