-- lease_return.lua: give back what a replica did not use of its blocks (on shutdown), to
-- the window they were taken from; a counter already in a later window is left alone.
--
-- The layout (lease.RETURN states it too; tests/test_redis_lease.py checks both agree):
-- KEYS  per counter: counter
-- ARGV  head: replica
-- ARGV  per counter: window_start unused
-- KEYS are the counter keys; ARGV is the head, then the number of counters and that many
-- rows. Returns the number of hits given back.

local COUNTER_ARGS = 2

local holder = 'L:' .. ARGV[1]
local back = 0
local a = 3
for i = 1, tonumber(ARGV[2]) do
  local ws, unused = ARGV[a], tonumber(ARGV[a + 1])
  local held = redis.call('HMGET', KEYS[i], 's', 'n')
  if held[1] == ws then
    local give = math.min(unused, tonumber(held[2]) or 0)
    redis.call('HINCRBY', KEYS[i], 'n', -give)
    redis.call('HDEL', KEYS[i], holder)
    back = back + give
  end
  a = a + COUNTER_ARGS
end
return back
