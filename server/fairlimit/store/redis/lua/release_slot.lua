-- release_slot.lua: give back a request id's slot in each concurrency pool of one slot
-- group (the stream-done call, or the undo of an acquire whose rates were refused;
-- store/redis/slots.py calls this, store/slots.py is the reference).
--
-- The layout (slots.RELEASE_SLOT states it too; tests/store/test_redis_script.py checks both agree):
-- KEYS  per pool: ids owner held
-- ARGV  head: now
-- ARGV  per pool: request_id client
-- KEYS are each pool's keys in turn; ARGV is the head, then the number of pools, then that
-- many rows.
--
-- A slot is given back only while it is held and not yet expired (an expired one is left
-- for the next acquire, which counts it as expired): a release without its acquire, or a
-- second release, changes nothing; at a cap pool neither does a release by a client other
-- than the one that took the slot. now "" = Redis TIME; client "" = not a cap pool;
-- request_id "" = the live slot (of client, at a cap) that expires first, ties by id
-- (a rule released by negative hits, core/concurrency.py).
-- Returns {given per pool: 1 | 0}.

local POOL_ARGS, POOL_KEYS = 2, 3

local now = clock(ARGV[1])  -- clock.lua

local given = {}
local a = 3
for i = 1, tonumber(ARGV[2]) do
  local k = (i - 1) * POOL_KEYS
  local ids, owner, held = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  local id, client = ARGV[a], ARGV[a + 1]
  if id == '' then
    id = nil
    for _, held_id in ipairs(redis.call('ZRANGEBYSCORE', ids, '(' .. string.format('%.17g', now), '+inf')) do
      if client == '' or redis.call('HGET', owner, held_id) == client then
        id = held_id
        break
      end
    end
    id = id or ''
  end
  local expiry = redis.call('ZSCORE', ids, id)
  given[i] = 0
  -- at a cap, only the client that took the slot gives it back
  local mine = client == '' or redis.call('HGET', owner, id) == client
  if expiry and tonumber(expiry) > now and mine then
    redis.call('ZREM', ids, id)
    if client ~= '' and redis.call('HDEL', owner, id) == 1 then
      if redis.call('HINCRBY', held, 'n:' .. client, -1) <= 0 then
        redis.call('HDEL', held, 'n:' .. client, 'l:' .. client, 'w:' .. client)
      end
    end
    given[i] = 1
  end
  a = a + POOL_ARGS
end
return given
