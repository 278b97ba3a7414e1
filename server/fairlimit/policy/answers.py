"""What the failure policy answers in the Store's own types when the store did not decide.

A call the store did not answer (it failed, or the breaker kept it from being asked) gets,
under ``--failure-mode open`` or ``local``, an answer of the type the store would have given,
marked ``Unanswered``: an admit let through with no limit, an acquire that holds nothing, a
settlement that settled nothing. Under ``local`` an admit the store did not answer is
decided by this process's part of the limits instead: a ``DecidedHere``, which carries the
scaled plan its counts are of. ``statuses`` reads either kind, so a flow handles every
answer the same way.
"""

from dataclasses import dataclass

from fairlimit.core import admission
from fairlimit.core.admission import Code, Outcome, Said, Status
from fairlimit.core.concurrency import SlotOutcome
from fairlimit.core.plan import Plan
from fairlimit.core.reserve import Settled


class Unanswered:
    """Marks the failure mode's answer to a call the store did not answer."""

    __slots__ = ()


@dataclass(slots=True)
class Unlimited(Outcome, Unanswered):
    """An admit let through: no limit applied, nothing charged."""


@dataclass(slots=True)
class Unheld(SlotOutcome, Unanswered):
    """An acquire let through: no slot taken, so none to give back."""


@dataclass(frozen=True, slots=True)
class Unsettled(Settled, Unanswered):
    """A settlement that did not happen: the reservation stays as charged."""


@dataclass(slots=True)
class DecidedHere(Outcome):
    """An admit decided by this process alone (``--failure-mode local``), of ``plan``: the
    plan asked, scaled to this process's part (its statuses report the part's limits)."""

    plan: Plan | None = None

    @classmethod
    def of(cls, outcome: Outcome, plan: Plan) -> "DecidedHere":
        return cls(outcome.admitted, outcome.counts, outcome.shared, outcome.bounds,
                   outcome.now, outcome.full_at, plan)  # fmt: skip


def unanswered(answer: object) -> bool:
    """Whether ``answer`` is the failure mode's, the store having decided nothing."""
    return isinstance(answer, Unanswered)


def open_statuses(descriptors: int) -> tuple[Status, ...]:
    """What ``--failure-mode open`` answers: OK for every descriptor, no limit."""
    return tuple(Status(Code.OK, None, 0, 0.0) for _ in range(descriptors))


def statuses(
    plan: Plan, outcome: Outcome, now: float, said: Said | None = None
) -> tuple[Status, ...]:
    """Each descriptor's status from an admit's answer to ``plan`` at ``now`` (the store's
    clock when it gives one); OK with no limit for an answer let through. With ``said``
    (the plan's last statuses, for a plan kept from call to call), moved from those when
    only its counts moved since (``admission.moved``: a hot payload's next request), else
    worked out whole and kept there."""
    if isinstance(outcome, Unanswered):
        return open_statuses(len(plan.descriptors))
    if type(outcome) is DecidedHere and outcome.plan is not None:
        plan = outcome.plan
    at = now if outcome.now is None else outcome.now
    if said is None or type(outcome) is not Outcome:
        return admission.statuses(plan, outcome, at)
    last = said.outcome
    out = None if last is None else admission.moved(plan, last, said.at, said.statuses, outcome, at)
    if out is None:
        out = admission.statuses(plan, outcome, at)
        said.outcome, said.at, said.statuses = outcome, at, out
    return out
