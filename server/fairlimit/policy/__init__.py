"""The failure policy around the store: what a call gets when the store fails or stalls.

guarded.py (FailurePolicy, a Store around the store: the failure mode's answers, shedding,
counting), breaker.py (when the store is not asked), answers.py (the answers of a store that
decided nothing, in the Store's own types), alone.py (--failure-mode local's course) and
local.py (this process's part of every limit, and the write-back).
"""
