-- prune.lua: drop the rows of a cap's clients that folding would make fresh rows, a few
-- clients a call (store/redis/division.py finds them while it divides the cap; the memory
-- store drops the same rows at a new period, store/memory.py). Without it a row would live
-- as long as its cap is used.
--
-- KEYS  rows
-- ARGV  stale_period last_window client...
-- A client's row is dropped only while it is still stale: its period below stale_period
-- (STALE periods untouched: no history left) and its window below last_window (neither
-- this window nor the one before: nothing it asked predicts its demand). A request since
-- has moved it on, and it stays. Returns the number of rows dropped.

local stale_period, last_window = tonumber(ARGV[1]), tonumber(ARGV[2])
local dropped = 0
for i = 3, #ARGV do
  local client = ARGV[i]
  local v = redis.call('HMGET', KEYS[1], ROW_FIELD.period .. ':' .. client,
    ROW_FIELD.window .. ':' .. client)
  if v[1] and v[2] and tonumber(v[1]) < stale_period and tonumber(v[2]) < last_window then
    local fields = {}
    for j, f in ipairs(ROW) do fields[j] = ROW_FIELD[f] .. ':' .. client end
    redis.call('HDEL', KEYS[1], unpack(fields))
    dropped = dropped + 1
  end
end
return dropped
