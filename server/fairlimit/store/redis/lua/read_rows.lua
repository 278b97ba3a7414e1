-- read_rows.lua: the rows of some of a cap's clients, for a division made outside the admit
-- script (store/redis/division_rows.py, read_clients). Registered alone: it reads no clock
-- and no contract, and writes nothing.
--
-- KEYS  the clients' row keys (<rows>:<client>: one cap's, so one slot), READ_STEP at most
-- ARGV  the fields to read of each row (what a division reads: core/sharing.DIVIDED_BY's,
--       in that order)
-- Returns, per key, HMGET of those fields (false for a field the row lacks, and for every
-- field of a client without a row of its own). One call in place of an HMGET each: the
-- caller's cost is per reply (issue 41), and READ_STEP rows keep a call short.

local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('HMGET', KEYS[i], unpack(ARGV))
end
return out
