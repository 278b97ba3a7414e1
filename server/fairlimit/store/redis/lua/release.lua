-- release.lua: undo what admit.lua charged for one slot group of a multi-slot request that
-- another group refused (store/redis/store.py, the two-phase admission across slots), or
-- give back the unused hits of a lease block (core/lease.py; demand = "1").
--
-- The layout (script.RELEASE states it too; tests/store/test_redis_script.py checks both agree):
-- KEYS  per counter: counter
-- KEYS  per cap: rows
-- ARGV  head: now demand
-- ARGV  per counter: window hits
-- ARGV  per cap: period window
-- ARGV  per share: cap_index client hits
-- KEYS are the counter keys, then each cap's keys; ARGV is the head, then for counters,
-- caps and shares in turn: their number, then that many rows.
--
-- now is the clock admit.lua replied with, so the windows and the period are the ones it
-- charged; a count is decremented only while that window (or period) is still the current
-- one, as a later window starts from zero anyway. cap_index is 1-based into the caps. The
-- client's part in the division stays as admit.lua left it. A refused reservation's
-- demand was real and stays (demand = "0"); a lease block's unused hits were counted as
-- demand when reserved and are taken out of it too (demand = "1").
-- Returns 1.

local COUNTER_ARGS, CAP_ARGS, SHARE_ARGS, CAP_KEYS = 2, 2, 3, 1

local function whole(x)
  return string.format('%.0f', x)
end

local function fmt(x)
  return string.format('%.17g', x)
end

local function add(key, field, by)
  local held = redis.call('HGET', key, field)
  if held then redis.call('HSET', key, field, fmt(tonumber(held) + by)) end
end

local now = tonumber(ARGV[1])
local demand = ARGV[2] == '1'
local a = 3
local n = tonumber(ARGV[a])
for i = 1, n do
  local w, hits = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  if hits ~= 0 and redis.call('HGET', KEYS[i], 's') == whole(math.floor(now / w) * w) then
    redis.call('HINCRBY', KEYS[i], 'n', -hits)
  end
  a = a + COUNTER_ARGS
end
a = a + 1
local caps = {}
for j = 1, tonumber(ARGV[a]) do
  local period, w = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  caps[j] = {rows = KEYS[n + j], p = math.floor(now / period), ws = math.floor(now / w) * w}
  a = a + CAP_ARGS
end
a = a + 1
for _ = 1, tonumber(ARGV[a]) do
  local cap, client, hits = caps[tonumber(ARGV[a + 1])], ARGV[a + 2], tonumber(ARGV[a + 3])
  local held = redis.call('HMGET', cap.rows, ROW_FIELD.window .. ':' .. client,
    ROW_FIELD.period .. ':' .. client)
  if hits ~= 0 and tonumber(held[1] or '') == cap.ws then
    add(cap.rows, ROW_FIELD.admitted .. ':' .. client, -hits)
    if demand then add(cap.rows, ROW_FIELD.asked .. ':' .. client, -hits) end
  end
  if hits ~= 0 and tonumber(held[2] or '') == cap.p then
    add(cap.rows, ROW_FIELD.period_admitted .. ':' .. client, -hits)
    if demand then add(cap.rows, ROW_FIELD.period_asked .. ':' .. client, -hits) end
  end
  a = a + SHARE_ARGS
end
return 1
