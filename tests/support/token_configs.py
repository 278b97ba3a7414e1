"""Token budgets charged after the response (charge_when_over_limit), as the limiter and Redis
store tests share them."""

TOKENS = """
domain: llm
descriptors:
  - key: provider
    value: openai
    rate_limit: {unit: minute, requests_per_unit: 1000, charge_when_over_limit: true}
    fair_share: {active_clients: 2}
    descriptors:
      - key: tenant
        rate_limit: {unit: minute, requests_per_unit: 100, charge_when_over_limit: true}
  - key: plain
    rate_limit: {unit: minute, requests_per_unit: 100}
"""
