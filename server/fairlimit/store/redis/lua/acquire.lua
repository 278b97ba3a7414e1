-- acquire.lua: take a slot for a request id in every concurrency pool of one slot group,
-- all or none (core/concurrency.py states the rule, store/slots.py is the reference;
-- store/redis/slots.py calls this by EVALSHA and builds the arguments).
--
-- The layout (slots.ACQUIRE states it too; tests/store/test_redis_script.py checks both agree):
-- KEYS  per pool: ids owner held want
-- ARGV  head: now
-- ARGV  per pool: request_id limit ttl client client_limit bound weight held_cursor want_cursor want_stamp
-- KEYS are each pool's keys in turn; ARGV is the head, then the number of pools, then that
-- many rows.
--
-- ids    sorted set: request id -> expiry (seconds)
-- owner  hash, at a cap: request id -> client
-- held   hash, at a cap: n: + client = slots held, l: / w: + client = its limit and weight
-- want   hash, at a cap, lives DEMAND_MS from its first write: r: + client = refused
--        acquires, l: / w: as in held; g = its stamp (Redis TIME in microseconds, set by
--        the call that made it)
-- now "" = Redis TIME; client "" = not a cap pool (owner, held and want unused); bound is
-- the client's fair bound at the cap ("inf" when the caller has no recent state), computed
-- by core.concurrency.fair_bound from the state this script returned to earlier calls.
-- held_cursor, want_cursor: where the caller's read of each hash goes on ("0": from the
-- start); want_stamp: the stamp of the want hash want_cursor belongs to (another one is
-- read from the start).
-- Returns {1 | 0, now, in_pool, expired, states} (1 = every slot taken, 0 = nothing taken;
--   in_pool = slots held in each pool before, expired ones gone; expired = slots each pool
--   gave back by expiry; states = {pool index, held_cursor, held part, want_stamp,
--   want_cursor, want part, own held, own refused} for each cap pool, after this call).
-- A part is a flat list of fields and values: the whole hash while Redis keeps it as a
-- listpack (its cursor is then ""), else one HSCAN step of COUNT CHUNK from the cursor given
-- (its cursor the next one, "0" at the end), so that no call reads more of a cap than a
-- bounded part (issue 41); own held / own refused: the client's n: and r: (false: none).
-- A want hash that does not exist reads as empty, stamped now.
-- Every key written gets a TTL.

local POOL_ARGS, POOL_KEYS = 10, 4

local EPS = 1e-9
local SLACK_MS = 1000
local DEMAND_MS = 1000
local CHUNK = 128  -- cap_view.STATE_CHUNK

local function num(s)
  if s == 'inf' then return math.huge end
  return tonumber(s)
end

local now = clock(ARGV[1])  -- clock.lua

local function stamp()
  local t = redis.call('TIME')
  return t[1] .. string.format('%06d', tonumber(t[2]))
end

local rows = {}
local a = 3
for i = 1, tonumber(ARGV[2]) do
  local k = (i - 1) * POOL_KEYS
  rows[i] = {ids = KEYS[k + 1], owner = KEYS[k + 2], held = KEYS[k + 3], want = KEYS[k + 4],
    id = ARGV[a], limit = tonumber(ARGV[a + 1]), ttl = tonumber(ARGV[a + 2]),
    client = ARGV[a + 3], climit = ARGV[a + 4], bound = num(ARGV[a + 5]),
    weight = ARGV[a + 6], held_cursor = ARGV[a + 7], want_cursor = ARGV[a + 8],
    want_stamp = ARGV[a + 9]}
  a = a + POOL_ARGS
end

-- Give back what has expired (score <= now), keeping a cap's per-client counts right.
local function expire(r)
  local gone = redis.call('ZRANGEBYSCORE', r.ids, '-inf', now)
  if #gone == 0 then return 0 end
  for _, id in ipairs(gone) do
    local c = r.client ~= '' and redis.call('HGET', r.owner, id)
    if c then
      redis.call('HDEL', r.owner, id)
      if redis.call('HINCRBY', r.held, 'n:' .. c, -1) <= 0 then
        redis.call('HDEL', r.held, 'n:' .. c, 'l:' .. c, 'w:' .. c)
      end
    end
  end
  redis.call('ZREMRANGEBYSCORE', r.ids, '-inf', now)
  return #gone
end

local in_pool, expired = {}, {}
for i, r in ipairs(rows) do
  expired[i] = expire(r)
  in_pool[i] = redis.call('ZCARD', r.ids)
end

local ok = true
local extra = {}  -- slots this request takes before, in the same pool
for i, r in ipairs(rows) do
  local more = extra[r.ids] or 0
  extra[r.ids] = more + 1
  if redis.call('ZSCORE', r.ids, r.id) or in_pool[i] + more + 1 > r.limit then
    ok = false
  elseif r.client ~= '' then
    local held = tonumber(redis.call('HGET', r.held, 'n:' .. r.client) or '0')
    if held + more + 1 > math.min(num(r.climit), r.bound) + EPS then ok = false end
  end
  if not ok then break end
end

for _, r in ipairs(rows) do
  local keep = math.ceil(r.ttl * 1000) + SLACK_MS
  if ok then
    redis.call('ZADD', r.ids, string.format('%.17g', now + r.ttl), r.id)
    redis.call('PEXPIRE', r.ids, keep)
    if r.client ~= '' then
      redis.call('HSET', r.owner, r.id, r.client)
      redis.call('HINCRBY', r.held, 'n:' .. r.client, 1)
      redis.call('HSET', r.held, 'l:' .. r.client, r.climit, 'w:' .. r.client, r.weight)
      redis.call('PEXPIRE', r.owner, keep)
      redis.call('PEXPIRE', r.held, keep)
    end
  elseif r.client ~= '' then
    local fresh = redis.call('EXISTS', r.want) == 0
    redis.call('HINCRBY', r.want, 'r:' .. r.client, 1)
    redis.call('HSET', r.want, 'l:' .. r.client, r.climit, 'w:' .. r.client, r.weight)
    if fresh then redis.call('PEXPIRE', r.want, DEMAND_MS) end
  end
end

-- A bounded part of a hash (the header says which). A hash Redis keeps as a listpack (at
-- most hash-max-listpack-entries fields) is read whole: HSCAN would return it all too, at
-- twice HGETALL's cost.
local function part(key, cursor)
  if redis.call('OBJECT', 'ENCODING', key) ~= 'hashtable' then
    return {'', redis.call('HGETALL', key)}
  end
  return redis.call('HSCAN', key, cursor, 'COUNT', CHUNK)
end

local states = {}
for i, r in ipairs(rows) do
  if r.client ~= '' then
    local since = redis.call('HGET', r.want, 'g')
    if not since then
      since = stamp()
      -- a want hash this call made (or an earlier version did) is stamped now
      if redis.call('EXISTS', r.want) == 1 then redis.call('HSET', r.want, 'g', since) end
    end
    local held = part(r.held, r.held_cursor)
    local want = part(r.want, since == r.want_stamp and r.want_cursor or '0')
    states[#states + 1] = {i, held[1], held[2], since, want[1], want[2],
      redis.call('HGET', r.held, 'n:' .. r.client), redis.call('HGET', r.want, 'r:' .. r.client)}
  end
end
return {ok and 1 or 0, string.format('%.17g', now), in_pool, expired, states}
