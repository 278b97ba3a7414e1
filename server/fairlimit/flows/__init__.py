"""The limiter's three flows, one room each: rates (flows/rates.py), slots (flows/slots.py)
and tokens (flows/tokens.py). Each calls the store through the failure policy (policy/)."""
