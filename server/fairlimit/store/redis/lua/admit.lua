-- admit.lua: the all-or-nothing admission of one slot group of a plan, with the λ
-- hand-back (core/admission.py states the rule, store/memory.py is the reference;
-- store/redis/store.py calls this by EVALSHA, store/redis/script.py builds the arguments).
--
-- The layout (script.ADMIT states it too; tests/test_redis_script.py checks both agree):
-- KEYS  per counter: counter
-- KEYS  per cap: meta cur prev adm lock
-- ARGV  head: now may_lock lock_ms
-- ARGV  per counter: limit window hits shadow
-- ARGV  per cap: period window capacity declared cap given_period given_level f_u f_a f_l f_j f_t f_s
-- ARGV  per share: cap_index client limit weight hits shadow
-- KEYS are the counter keys, then each cap's keys; ARGV is the head, then for counters,
-- caps and shares in turn: their number, then that many rows.
--
-- counter  hash: s = window start, n = count in that window
-- meta     hash: p = period of the level in force, v = level "none"|"inf"|λ, cap, declared,
--          and the last period's fairness figures f_*
-- cur      hash, this period: _p, _sw seen weight, d:/a:/l:/w: + client = demand, admitted,
--          limit, weight
-- prev     the last period's cur, read to compute λ
-- adm      hash: _s = cap window start, c: + client = admitted at the cap
-- lock     string: the period whose λ a replica is computing
-- now ("" = Redis TIME), may_lock and shadow "1" | "0"; given_period "" = no λ given,
-- given_level and the figures (utilization, active, level, jain, top, starved) then "";
-- cap_index is 1-based into the caps.
-- Returns {1 | 0, now, counts, admitted, bounds, fresh, rolled} (1 = charged, 0 = nothing
--       moved; bounds as strings; fresh[i] = 1 when share i's level is this period's own;
--       rolled = indexes of caps whose level was written by this call), or
--       {2, now, {cap index, period, prev as a flat hash}...} when this call won the λ lock
--       of a cap: nothing was recorded or charged; compute λ and call again with it.
-- Every key written gets a TTL. Floats cross the boundary as %.17g strings, so Lua and
-- Python see the same doubles.

local COUNTER_ARGS, CAP_ARGS, SHARE_ARGS, CAP_KEYS = 4, 13, 6, 5

local EPS = 1e-9
local SLACK_MS = 1000
local FIGURES = {'f_u', 'f_a', 'f_l', 'f_j', 'f_t', 'f_s'}

local function num(s)
  if s == 'inf' then return math.huge end
  return tonumber(s)
end

local function fmt(x)
  if x == math.huge then return 'inf' end
  return string.format('%.17g', x)
end

local function whole(x)
  return string.format('%.0f', x)
end

local may_lock, lock_ms = ARGV[2] == '1', ARGV[3]
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[1])
end

local a = 4
local counters, caps, shares = {}, {}, {}
for i = 1, tonumber(ARGV[a]) do
  local w = tonumber(ARGV[a + 2])
  local start = math.floor(now / w) * w
  counters[i] = {key = KEYS[i], limit = tonumber(ARGV[a + 1]), hits = tonumber(ARGV[a + 3]),
    shadow = ARGV[a + 4] == '1', ws = whole(start), ttl = (start + w - now) * 1000 + SLACK_MS}
  a = a + COUNTER_ARGS
end
a = a + 1
local n = #counters
for j = 1, tonumber(ARGV[a]) do
  local b = n + (j - 1) * CAP_KEYS
  local period, w = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local start = math.floor(now / w) * w
  local p = math.floor(now / period)
  local figures = {}
  for f = 1, 6 do figures[f] = ARGV[a + 7 + f] end
  caps[j] = {meta = KEYS[b + 1], cur = KEYS[b + 2], prev = KEYS[b + 3], adm = KEYS[b + 4],
    lock = KEYS[b + 5], period = period, window = w, capacity = tonumber(ARGV[a + 3]),
    declared = ARGV[a + 4], name = ARGV[a + 5], given_p = ARGV[a + 6], given_v = ARGV[a + 7],
    figures = figures, p = p, ps = whole(p), ws = whole(start),
    ttl = (start + w - now) * 1000 + SLACK_MS,
    keep = math.max(2 * w + 1, 2 * period + 10) * 1000}
  a = a + CAP_ARGS
end
a = a + 1
for i = 1, tonumber(ARGV[a]) do
  shares[i] = {cap = caps[tonumber(ARGV[a + 1])], client = ARGV[a + 2],
    limit = num(ARGV[a + 3]), weight = tonumber(ARGV[a + 4]), hits = tonumber(ARGV[a + 5]),
    shadow = ARGV[a + 6] == '1'}
  a = a + SHARE_ARGS
end

-- Move each cap to the period holding now: this period's demand starts empty, the last
-- period's becomes prev (or none, after a gap) - as _Cap.roll in store/memory.py.
local function roll(cap)
  local curp = redis.call('HGET', cap.cur, '_p')
  if curp == cap.ps then return end
  if curp and tonumber(curp) == cap.p - 1 then
    redis.call('RENAME', cap.cur, cap.prev)
  else
    redis.call('DEL', cap.prev, cap.cur)
  end
  redis.call('HSET', cap.cur, '_p', cap.ps)
  redis.call('PEXPIRE', cap.cur, cap.keep)
end

local function write_level(cap, level, figures)
  redis.call('HSET', cap.meta, 'p', cap.ps, 'v', level, 'cap', cap.name,
    'declared', cap.declared)
  if figures[1] == '' then
    redis.call('HDEL', cap.meta, unpack(FIGURES))
  else
    for f = 1, 6 do redis.call('HSET', cap.meta, FIGURES[f], figures[f]) end
  end
  redis.call('PEXPIRE', cap.meta, cap.keep)
  redis.call('DEL', cap.lock)
  cap.rolled = true
end

-- SET NX PX; a lock left by an earlier period (its holder died) is taken over.
local function take_lock(cap)
  if redis.call('SET', cap.lock, cap.ps, 'NX', 'PX', lock_ms) then return true end
  if redis.call('GET', cap.lock) ~= cap.ps then
    redis.call('SET', cap.lock, cap.ps, 'PX', lock_ms)
    return true
  end
  return false
end

-- The level in force for this period, whether it is this period's own, and whether this
-- call must hand back for λ to be computed.
local function level_of(cap)
  local meta = redis.call('HMGET', cap.meta, 'p', 'v')
  if meta[1] == cap.ps then return meta[2], true, false end
  if cap.given_p == cap.ps then
    write_level(cap, cap.given_v, cap.figures)
    return cap.given_v, true, false
  end
  if redis.call('HEXISTS', cap.prev, '_sw') == 0 then
    write_level(cap, 'none', {''})
    return 'none', true, false
  end
  if may_lock and take_lock(cap) then return nil, false, true end
  -- Another replica is computing λ: keep the last period's level meanwhile.
  if meta[1] and tonumber(meta[1]) == cap.p - 1 then return meta[2], false, false end
  return 'none', false, false
end

local need = {}
for j, cap in ipairs(caps) do
  roll(cap)
  local level, fresh, compute = level_of(cap)
  if compute then
    table.insert(need, {j, cap.ps, redis.call('HGETALL', cap.prev)})
  end
  cap.level, cap.fresh = level, fresh
end
if #need > 0 then return {2, fmt(now), need} end

-- Demand is recorded whether or not the request is admitted.
for _, s in ipairs(shares) do
  local cur, client = s.cap.cur, s.client
  if redis.call('HEXISTS', cur, 'd:' .. client) == 0 then
    redis.call('HSET', cur, 'l:' .. client, fmt(s.limit), 'w:' .. client, fmt(s.weight))
    local seen = tonumber(redis.call('HGET', cur, '_sw') or '0') + s.weight
    redis.call('HSET', cur, '_sw', fmt(seen))
  end
  redis.call('HINCRBY', cur, 'd:' .. client, s.hits)
end

local admitted = true
local counts, shared, bounds, fresh, rolled = {}, {}, {}, {}, {}
for i, c in ipairs(counters) do
  local held = redis.call('HMGET', c.key, 's', 'n')
  c.current = held[1] == c.ws
  counts[i] = c.current and tonumber(held[2]) or 0
  if not c.shadow and counts[i] + math.max(c.hits, 1) > c.limit then admitted = false end
end
for i, s in ipairs(shares) do
  local cap = s.cap
  local fair
  if cap.level == 'none' then
    local seen = tonumber(redis.call('HGET', cap.cur, '_sw'))
    fair = cap.capacity * s.weight / math.max(seen, s.weight)
  else
    fair = num(cap.level) * s.weight
  end
  local bound = math.min(s.limit, fair)
  local held = redis.call('HMGET', cap.adm, '_s', 'c:' .. s.client)
  shared[i] = held[1] == cap.ws and tonumber(held[2] or '0') or 0
  bounds[i], fresh[i] = fmt(bound), cap.fresh and 1 or 0
  if not s.shadow and shared[i] + math.max(s.hits, 1) > bound + EPS then admitted = false end
end
for j, cap in ipairs(caps) do
  if cap.rolled then table.insert(rolled, j) end
end

if admitted then
  for _, c in ipairs(counters) do
    if c.hits ~= 0 then
      if c.current then
        redis.call('HINCRBY', c.key, 'n', c.hits)
      else
        redis.call('HSET', c.key, 's', c.ws, 'n', c.hits)
        redis.call('PEXPIRE', c.key, math.ceil(c.ttl))
      end
    end
  end
  for _, s in ipairs(shares) do
    local cap = s.cap
    if s.hits ~= 0 then
      if redis.call('HGET', cap.adm, '_s') ~= cap.ws then
        redis.call('DEL', cap.adm)
        redis.call('HSET', cap.adm, '_s', cap.ws)
        redis.call('PEXPIRE', cap.adm, math.ceil(cap.ttl))
      end
      redis.call('HINCRBY', cap.adm, 'c:' .. s.client, s.hits)
      redis.call('HINCRBY', cap.cur, 'a:' .. s.client, s.hits)
    end
  end
end
return {admitted and 1 or 0, fmt(now), counts, shared, bounds, fresh, rolled}
