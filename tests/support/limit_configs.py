"""Rules with several limits that the operator views' tests share (issue 28), as YAML text
to splice into a descriptor file: each starts at a top-level rule's indentation.

``FOUR_LIMITS`` is a rule's ``rate_limits`` of every kind: a burst per second, a sliding 5
minutes, a gcra with a burst and a calendar month in a zone (the rule's key goes before it).
``CAP_OF_TWO`` is a fair_share cap whose second limit (10/s over 5 minutes, for 5 clients of
15/s) is contended while its first (100/s) is not.
"""

FOUR_LIMITS = """\
    rate_limits:
      - {unit: second, requests_per_unit: 20}
      - {duration: 5m, requests_per_unit: 3000, algorithm: sliding}
      - {unit: minute, requests_per_unit: 600, algorithm: gcra, burst: 30}
      - {unit: month, requests_per_unit: 1000000, calendar: Europe/Berlin}
"""

CAP_OF_TWO = """\
  - key: tenant
    rate_limits:
      - {unit: second, requests_per_unit: 100}
      - {unit: minute, multiplier: 5, requests_per_unit: 3000}
    fair_share: {active_clients: 5}
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 15}
"""
