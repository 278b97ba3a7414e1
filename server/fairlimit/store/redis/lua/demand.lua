-- demand.lua: keep one consumer's RLQS demand report and return every other consumer's
-- (quota/peers.py states what a report holds; store/redis/store.py calls this).
--
-- KEYS  demand (a hash: field = consumer, value = "<until>|<report>", until on this clock)
-- ARGV  now consumer ttl report
-- now ("" = Redis TIME); ttl in seconds. Fields past their until are deleted. Returns the
-- other consumers' live reports as a flat list {consumer, report, ...}. The key lives twice
-- ttl past the last call.

local now = clock(ARGV[1])  -- clock.lua
local me, ttl = ARGV[2], tonumber(ARGV[3])
redis.call('HSET', KEYS[1], me, string.format('%.17g', now + ttl) .. '|' .. ARGV[4])
redis.call('PEXPIRE', KEYS[1], math.ceil(2 * ttl * 1000))
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local field, value = all[i], all[i + 1]
  local bar = string.find(value, '|', 1, true)
  local until_at = bar and tonumber(string.sub(value, 1, bar - 1)) or nil
  if until_at == nil or until_at <= now then
    redis.call('HDEL', KEYS[1], field)
  elseif field ~= me then
    table.insert(out, field)
    table.insert(out, string.sub(value, bar + 1))
  end
end
return out
