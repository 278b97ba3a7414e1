"""``fairlimit simulate``: traffic scenarios through the real limiter on a simulated clock.

- ``scenario``: reading and checking a scenario file (ScenarioError, FILE: PATH: message),
  with ``clients`` (client entries) and ``reader`` (the reading itself).
- ``traffic``: when each client sends and what each request costs (phases, costs).
- ``engine``: the run, tick by tick, one fresh memory store per config (``run``; or the
  caller's store factory, ``run_async`` in the caller's loop), with
  ``retries`` (the pending retries) and ``measure`` (what it counts).
- ``levels``: the counters a request is charged at and what max-min could admit.
- ``report``: what a run measured, as text or JSON; ``plot``: the same drawn with matplotlib.
- ``rlqs``: the same run with the clients behind simulated RLQS Envoys (scenario key ``rlqs``).
"""

from fairlimit.simulate.engine import run
from fairlimit.simulate.report import ClientResult, Result
from fairlimit.simulate.scenario import load_scenario

__all__ = ["ClientResult", "Result", "load_scenario", "run"]
