-- admit.lua: the all-or-nothing admission of one slot group of a plan, with the λ
-- hand-back (core/admission.py and core/sharing.py state the rule, store/memory.py is the
-- reference; store/redis/store.py calls this by EVALSHA, store/redis/script.py builds the
-- arguments).
--
-- The layout (script.ADMIT states it too; tests/test_redis_script.py checks both agree):
-- KEYS  per counter: counter
-- KEYS  per cap: meta rows lock
-- ARGV  head: now may_lock lock_ms
-- ARGV  per counter: limit window hits shadow force
-- ARGV  per cap: period window capacity declared cap total given_period given_level given_reserved given_holders f_u f_a f_l f_j f_t f_s
-- ARGV  per share: cap_index client limit weight hits shadow sized below_counters below_shares force
-- KEYS are the counter keys, then each cap's keys; ARGV is the head, then for counters,
-- caps and shares in turn: their number, then that many rows.
--
-- counter  hash: s = window start, n = count in that window
-- meta     hash: p = period of the figures, v = λ "none"|"inf"|float, res = R, hold = its
--          holders, and what the period has seen (core/sharing.CapPeriod): rs, sh, u, o,
--          wsp, sw; cap, declared and
--          the last period's fairness figures f_*
-- rows     hash: per client the fields of core/sharing.Row as <field>:<client>
-- lock     string: the period whose λ a replica is computing
-- now ("" = Redis TIME), may_lock, shadow and sized "1" | "0"; total is the 1-based index
-- of the cap's own counter (0: not in this group); given_period "" = no λ given, then
-- given_level, given_reserved and the figures are "" too; cap_index is 1-based into the
-- caps; below_counters / below_shares list 1-based indexes ("," separated) of the levels
-- below the share in its descriptor: the cap sees the request as demand when they admit;
-- force "1" on the levels of a charge_when_over_limit rule: charged even when refused.
-- Returns {1 | 0, now, counts, admitted, bounds, fresh, rolled, within} (1 = charged, 0 =
--       nothing charged; bounds as strings; fresh[i] = 1 when share i's refusal may be
--       cached until the period ends: never, under fairness v2; rolled = indexes of caps whose λ was written by this call; within[i] = 1 when
--       share i was admitted within its plan), or
--       {2, now, {cap index, period, rows as a flat hash}...} when this call won the λ lock
--       of a cap: nothing was recorded or charged; compute λ and call again with it.
-- Every key written gets a TTL. Floats cross the boundary as %.17g strings, so Lua and
-- Python see the same doubles; every formula below is core/sharing.py's, in its order.

local COUNTER_ARGS, CAP_ARGS, SHARE_ARGS, CAP_KEYS = 5, 16, 10, 3

local EPS = 1e-9
local ALPHA, STALE = 0.5, 64
-- A key outlives its window by a second; with the caller's clock (tests, simulations) TTLs
-- still run on Redis's own clock, so a slow run must not see a window's counter expire
-- before its simulated end: a minute of slack then.
local SLACK_MS = ARGV[1] == '' and 1000 or 60000
local FIGURES = {'f_u', 'f_a', 'f_l', 'f_j', 'f_t', 'f_s'}
local ROW = {'ws', 'a', 'd', 'pk', 'pd', 'pa', 'oo', 'sp', 'r', 'q', 'qa', 'dk', 'l', 'w'}
local PERIOD = {'rs', 'u', 'o', 'wsp', 'sw'}

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

local function list(s)
  local out = {}
  for x in string.gmatch(s, '%d+') do table.insert(out, tonumber(x)) end
  return out
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
    shadow = ARGV[a + 4] == '1', force = ARGV[a + 5] == '1', ws = whole(start),
    ttl = (start + w - now) * 1000 + SLACK_MS}
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
  for f = 1, 6 do figures[f] = ARGV[a + 10 + f] end
  caps[j] = {meta = KEYS[b + 1], rows = KEYS[b + 2], lock = KEYS[b + 3], period = period,
    window = w, capacity = tonumber(ARGV[a + 3]), declared = tonumber(ARGV[a + 4]),
    name = ARGV[a + 5], total = tonumber(ARGV[a + 6]), given_p = ARGV[a + 7],
    given_v = ARGV[a + 8], given_r = ARGV[a + 9], given_h = ARGV[a + 10], figures = figures,
    p = p, ps = whole(p),
    start = start, keep = math.max(2 * w + 1, STALE * period) * 1000}
  a = a + CAP_ARGS
end
a = a + 1
for i = 1, tonumber(ARGV[a]) do
  shares[i] = {cap = caps[tonumber(ARGV[a + 1])], client = ARGV[a + 2],
    limit = num(ARGV[a + 3]), weight = tonumber(ARGV[a + 4]), hits = tonumber(ARGV[a + 5]),
    shadow = ARGV[a + 6] == '1', sized = ARGV[a + 7] == '1', below_c = list(ARGV[a + 8]),
    below_s = list(ARGV[a + 9]), force = ARGV[a + 10] == '1'}
  a = a + SHARE_ARGS
end

-- --- the cap's period: λ, R and what the period has seen ---------------------------------

local function write_level(cap, level, reserved, holders, figures)
  redis.call('HSET', cap.meta, 'p', cap.ps, 'v', level, 'res', reserved, 'hold', holders,
    'cap', cap.name, 'declared', cap.declared, 'rs', '0', 'sh', '0', 'u', '0', 'o', '0',
    'wsp', '0', 'sw', '0')
  if figures[1] == '' or figures[1] == nil then
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

-- Whether this period's figures are in meta (written now if given or if there is no row);
-- 'compute' when this call must hand back for λ.
local function level_of(cap)
  local p = redis.call('HGET', cap.meta, 'p')
  if p == cap.ps then return true end
  if cap.given_p == cap.ps then
    write_level(cap, cap.given_v, cap.given_r, cap.given_h, cap.figures)
    return true
  end
  if redis.call('EXISTS', cap.rows) == 0 then
    write_level(cap, 'none', '0', '0', {''})
    return true
  end
  if may_lock and take_lock(cap) then return 'compute' end
  return false  -- another replica is computing λ: keep the last period's meanwhile
end

local function load_period(cap)
  local m = redis.call('HMGET', cap.meta, 'v', 'res', 'rs', 'u', 'o', 'wsp', 'sw', 'hold', 'sh')
  local v = m[1] or 'none'
  cap.level = (v ~= 'none') and num(v) or nil
  cap.reserved = tonumber(m[2] or '0')
  cap.rs, cap.u, cap.o = tonumber(m[3] or '0'), tonumber(m[4] or '0'), tonumber(m[5] or '0')
  cap.wsp, cap.sw = tonumber(m[6] or '0'), tonumber(m[7] or '0')
  cap.hold, cap.sh = tonumber(m[8] or '0'), tonumber(m[9] or '0')
end

local function save_period(cap)
  redis.call('HSET', cap.meta, 'rs', fmt(cap.rs), 'sh', fmt(cap.sh), 'u', fmt(cap.u),
    'o', fmt(cap.o), 'wsp', fmt(cap.wsp), 'sw', fmt(cap.sw))
  redis.call('PEXPIRE', cap.meta, cap.keep)
end

local need = {}
for j, cap in ipairs(caps) do
  local state = level_of(cap)
  if state == 'compute' then
    table.insert(need, {j, cap.ps, redis.call('HGETALL', cap.rows)})
  end
  cap.fresh = state == true
end
if #need > 0 then return {2, fmt(now), need} end

-- --- rows (core/sharing.py: fold, predicted, allowance, touch, verdict) -------------------

local function load_row(s)
  local fields = {}
  for i, f in ipairs(ROW) do fields[i] = f .. ':' .. s.client end
  local v = redis.call('HMGET', s.cap.rows, unpack(fields))
  local row = {}
  for i, f in ipairs(ROW) do row[f] = tonumber(v[i] or '') end
  if row.pk == nil then
    row = {ws = -1, a = 0, d = 0, pk = -1, pd = 0, pa = 0, oo = 0, sp = 0, r = 0, q = 0,
      qa = 0, dk = 0}
  end
  row.l, row.w = s.limit, s.weight
  return row
end

local function save_row(s, row)
  local args = {}
  for _, f in ipairs(ROW) do
    table.insert(args, f .. ':' .. s.client)
    table.insert(args, fmt(row[f]))
  end
  redis.call('HSET', s.cap.rows, unpack(args))
  redis.call('PEXPIRE', s.cap.rows, s.cap.keep)
end

local function fold(row, p, start)
  if row.pk >= p then return false end
  local gap = p - row.pk
  local r, q, qa
  if gap > STALE then
    r, q, qa = 0, 0, 0
  else
    if gap == 1 then q, qa = row.pd, row.pa else q, qa = 0, 0 end
    r = (ALPHA * row.pd + (1 - ALPHA) * row.r) * (1 - ALPHA) ^ (gap - 1)
  end
  if row.ws ~= start then row.a, row.d = 0, 0 end
  row.r, row.q, row.qa = r, q, qa
  row.pd, row.pa, row.oo, row.sp, row.pk, row.ws = 0, 0, 0, 0, p, start
  row.dk = row.d
  return true
end

local function predicted(dk, r, q, cap)
  local begun = cap.p * cap.period
  local done = math.floor((begun - cap.start) / cap.period + 0.5)
  local rate = math.max(r, q, done > 0 and dk / done or 0)
  return dk + rate * (cap.start + cap.window - begun) / cap.period
end

local function allowance(demand, limit, share)
  local want = math.ceil(math.min(demand, limit) - EPS)
  if share == math.huge then return want end
  return math.min(want, math.floor(share + EPS))
end

local function plan_of(row, cap, s)
  if cap.level == nil then return 0 end
  local demand = predicted(row.dk, row.r, row.q, cap)
  return allowance(demand, s.limit, cap.level * s.weight)
end

local function touch(row, cap, s)
  local held = plan_of(row, cap, s) - row.a
  if held > 0 then
    cap.rs = cap.rs + held
    cap.sh = cap.sh + 1
  end
  cap.sw = cap.sw + s.weight
end

local function verdict(row, cap, s, total)
  local h, limit, capacity = math.max(s.hits, 1), s.limit, cap.capacity
  local phi = 1
  if not s.sized then phi = math.min(1, (now - cap.start + cap.period) / cap.window) end
  if cap.level == nil then
    local cold = capacity * s.weight / math.max(cap.sw, cap.declared)
    return math.min(limit, cold * phi), true
  end
  local fair = limit
  if cap.level ~= math.huge then fair = math.min(limit, cap.level * s.weight * phi) end
  local plan = plan_of(row, cap, s)
  if row.a + 1 <= plan and row.a + h <= fair + EPS then return fair, true end
  if row.sp == 0 then
    row.sp = 1
    cap.wsp = cap.wsp + s.weight
  end
  local finish = cap.start + cap.window
  local left = (finish - now) / (finish - cap.p * cap.period)
  local unseen = math.max(0, cap.reserved - cap.rs)
  local kept = math.min(unseen, math.max(unseen * left, cap.hold - cap.sh))
  local reserved = math.max(0, cap.rs - cap.u) + kept
  local pace = capacity * phi
  local spare = total + h <= math.min(capacity - reserved, pace) + EPS
  local pool = cap.o + capacity - reserved - total
  if spare and row.oo + h <= pool * s.weight / cap.wsp + 1 + EPS then return limit, false end
  return math.min(fair, math.max(plan, row.a)), false
end

-- --- the decision ---------------------------------------------------------------------------

for _, cap in ipairs(caps) do load_period(cap) end

local admitted = true
local counts, shared, bounds, fresh, rolled, within = {}, {}, {}, {}, {}, {}
for i, c in ipairs(counters) do
  local held = redis.call('HMGET', c.key, 's', 'n')
  c.current = held[1] == c.ws
  counts[i] = c.current and tonumber(held[2]) or 0
  c.over = not c.shadow and counts[i] + math.max(c.hits, 1) > c.limit
  if c.over then admitted = false end
end
for _, s in ipairs(shares) do
  s.row = load_row(s)
  if fold(s.row, s.cap.p, s.cap.start) then touch(s.row, s.cap, s) end
end
for i, s in ipairs(shares) do
  local total = s.cap.total > 0 and counts[s.cap.total] or 0
  local bound, inside = verdict(s.row, s.cap, s, total)
  shared[i] = s.row.a
  -- fresh stays 0: under fairness v2 a claim refused now may be admitted later in the same
  -- period (the spare opens as reservations are released), so no claim may be cached.
  bounds[i], fresh[i], within[i] = fmt(bound), 0, inside and 1 or 0
  s.bound, s.within = bound, inside
  s.over = not s.shadow and shared[i] + math.max(s.hits, 1) > bound + EPS
  if s.over then admitted = false end
end
for j, cap in ipairs(caps) do
  if cap.rolled then table.insert(rolled, j) end
end

-- Demand: a cap sees the request when the levels below it admit (core/admission.demand_seen).
for _, s in ipairs(shares) do
  local below = true
  for _, i in ipairs(s.below_c) do if counters[i].over then below = false end end
  for _, i in ipairs(s.below_s) do if shares[i].over then below = false end end
  if below then
    s.row.d = s.row.d + s.hits
    s.row.pd = s.row.pd + s.hits
  end
end

-- Refused, only the levels of charge_when_over_limit rules are charged; admitted, all.
for _, c in ipairs(counters) do
  if c.hits ~= 0 and (admitted or c.force) then
    if c.current then
      redis.call('HINCRBY', c.key, 'n', c.hits)
    else
      redis.call('HSET', c.key, 's', c.ws, 'n', c.hits)
      redis.call('PEXPIRE', c.key, math.ceil(c.ttl))
    end
  end
end
for _, s in ipairs(shares) do
  if admitted or s.force then
    s.row.a = s.row.a + s.hits
    s.row.pa = s.row.pa + s.hits
    if s.within then
      s.cap.u = s.cap.u + s.hits
    else
      s.cap.o = s.cap.o + s.hits
      s.row.oo = s.row.oo + s.hits
    end
  end
end
for _, s in ipairs(shares) do save_row(s, s.row) end
for _, cap in ipairs(caps) do save_period(cap) end
return {admitted and 1 or 0, fmt(now), counts, shared, bounds, fresh, rolled, within}
