-- prune.lua: drop the rows of a cap's clients that folding would make fresh rows, a few
-- clients a call, the least recently written first (store/redis/division.py calls it after
-- a division, until a call drops fewer than it was asked to; the memory store drops the
-- same rows at a new period, store/memory.py). Without it a row would live as long as its
-- cap is used.
--
-- KEYS  rows seen (a client's row is the hash <rows>:<client>, or, written by an earlier
--       version, the fields <field>:<client> of rows: lua/admit/rows.lua)
-- ARGV  stale_period last_window below count
-- Takes the first count clients of seen written before below (a time: at most every
-- client stale at stale_period and last_window, by the clock of the cap's division). A
-- client's row is dropped only while it is still stale: its period below stale_period
-- (STALE periods untouched: no history left) and its window below last_window (neither
-- this window nor the one before: nothing it asked predicts its demand); a client of seen
-- without a row (expired by its TTL) is dropped from seen. A request since has moved it
-- on, and it stays. Returns the number of clients dropped.

local stale_period, last_window = tonumber(ARGV[1]), tonumber(ARGV[2])
local dropped = 0
local clients = redis.call('ZRANGE', KEYS[2], '-inf', '(' .. ARGV[3], 'BYSCORE', 'LIMIT', 0,
  tonumber(ARGV[4]))
for _, client in ipairs(clients) do
  local key = KEYS[1] .. ':' .. client
  local v = redis.call('HMGET', key, ROW_FIELD.period, ROW_FIELD.window)
  local legacy = not v[1]
  if legacy then
    v = redis.call('HMGET', KEYS[1], ROW_FIELD.period .. ':' .. client,
      ROW_FIELD.window .. ':' .. client)
  end
  if not v[1] or not v[2] then
    redis.call('ZREM', KEYS[2], client)
    dropped = dropped + 1
  elseif tonumber(v[1]) < stale_period and tonumber(v[2]) < last_window then
    if legacy then
      local fields = {}
      for j, f in ipairs(ROW) do fields[j] = ROW_FIELD[f] .. ':' .. client end
      redis.call('HDEL', KEYS[1], unpack(fields))
    else
      redis.call('DEL', key)
    end
    redis.call('ZREM', KEYS[2], client)
    dropped = dropped + 1
  end
end
return dropped
