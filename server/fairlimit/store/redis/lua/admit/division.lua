-- admit/division.lua: part 3 of the admit script (lua/admit/args.lua states its layout and
-- the order of the parts): the division in force at a cap, read, given, made empty or due
-- (then this call takes the cap's lock and hands back for it), and a row leaving and
-- entering it.
-- KEYS: each cap's meta hash (the division, cap, declared, f_*), rows and seen (EXISTS:
-- whether the cap holds a row), lock, and seen (its first, stale_rows).
-- ARGV: none (args.lua parsed the given division and figures into caps).
-- Reads: DIVISION DIVISION_FIELD FORCES SPLIT AMORTISE (contract), num fmt whole FIGURES
-- NONE OPEN HELD may_lock lock_ms now (args.lua), part want left (rows.lua).
-- Defines: load_division write_division given_division stale count leave enter take_lock
-- division_of stale_rows closing_of.

-- --- the division (core/sharing.py: Division, leave, enter, stale_division) ----------------

local function load_division(cap)
  local v = redis.call('HMGET', cap.meta, unpack(DIVISION_NAMES))
  if v[1] == false then return nil end
  local d = {}
  for i = 1, #DIVISION do
    local f = DIVISION[i]
    if f == 'excluded' then d[f] = v[i] or '' else d[f] = num(v[i] or '0') end
  end
  return d
end

local function write_division(cap, d)
  local args = {}
  for i = 1, #DIVISION do
    local f = DIVISION[i]
    args[2 * i - 1] = DIVISION_NAMES[i]
    if f == 'excluded' then args[2 * i] = d[f] else args[2 * i] = fmt(d[f]) end
  end
  redis.call('HSET', cap.meta, 'cap', cap.name, 'declared', cap.declared, unpack(args))
  redis.call('PEXPIRE', cap.meta, cap.keep)
end

-- The given values are "," separated in DIVISION order; the last, excluded, is a client
-- value and may hold commas: it is the rest of the text.
local function given_division(cap)
  local d, at = {}, 1
  for i, f in ipairs(DIVISION) do
    if i == #DIVISION then
      d[f] = string.sub(cap.given, at)
    else
      local comma = string.find(cap.given, ',', at, true)
      d[f] = num(string.sub(cap.given, at, comma - 1))
      at = comma + 1
    end
  end
  return d
end

local function stale(d, c)
  if d == nil then return true end
  local made = math.floor(d.epoch / FORCES)
  if made == c.epoch then return false end
  if math.floor(made / SPLIT) ~= c.period then return true end
  return d.asks * AMORTISE >= d.rows
end

local function count(d, kind, weight, fixed, rate, sign)
  if kind == HELD then
    d.held = math.max(0, d.held + sign * weight)
  elseif kind == OPEN then
    d.fixed = d.fixed + sign * fixed
    d.rate = d.rate + sign * rate
  end
end

local function leave(d, row, s)
  if row.epoch == d.epoch then
    count(d, row.kind, row.weight, row.fixed, row.rate, -1)
  elseif s.client ~= d.excluded then
    local c = s.cap
    local at = {period_len = c.period_len, window = c.window, now = d.at,
      period = math.floor(d.at / c.period_len), start = math.floor(d.at / c.window) * c.window}
    at.finish = at.start + c.window
    local kind, fixed, rate = part(row, at, d.level)
    count(d, kind, row.weight, fixed, rate, -1)
  end
  row.epoch, row.kind = d.epoch, NONE
end

local function enter(d, row, kind, c)
  row.epoch = d.epoch
  if kind == OPEN then row.fixed, row.rate = want(row, c, 0) else row.fixed, row.rate = 0, 0 end
  row.kind = kind
  count(d, kind, row.weight, row.fixed, row.rate, 1)
  if kind == OPEN then
    d.top = math.max(d.top, (row.fixed + row.rate * left(c)) / row.weight)
  end
end

-- SET NX PX; a lock left by an earlier epoch (its holder died) is taken over.
local function take_lock(cap, epoch)
  local e = whole(epoch)
  if redis.call('SET', cap.lock, e, 'NX', 'PX', lock_ms) then return true end
  if redis.call('GET', cap.lock) ~= e then
    redis.call('SET', cap.lock, e, 'PX', lock_ms)
    return true
  end
  return false
end

-- The division in force: the one in meta, or the one given (written now), or an empty one
-- when the cap has no rows; 'compute' when this call must hand back for it.
local function division_of(cap)
  local d = load_division(cap)
  -- a division made for an earlier sub-period (in the background, store/redis/division.py)
  -- is still taken when it is newer than the one in force
  if cap.given_e ~= '' and math.floor(tonumber(cap.given_e) / FORCES) <= cap.epoch and
      (d == nil or tonumber(cap.given_e) > d.epoch) then
    d = given_division(cap)
    write_division(cap, d)
    local fig = cap.figures
    if fig[1] == '' then
      redis.call('HDEL', cap.meta, unpack(FIGURES))
    else
      for f = 1, 6 do redis.call('HSET', cap.meta, FIGURES[f], fig[f]) end
    end
    -- the lock, unless a later division's computer holds it now
    if tonumber(redis.call('GET', cap.lock) or '0') <= tonumber(cap.given_e) then
      redis.call('DEL', cap.lock)
    end
    cap.rolled = true
    return d
  end
  if not stale(d, cap) then return d end
  if redis.call('EXISTS', cap.seen, cap.rows) == 0 then  -- no row: none indexed, none of old
    d = {epoch = FORCES * cap.epoch, at = now, level = math.huge, rows = 0, held = 0, fixed = 0,
      rate = 0, asks = 0, forced = 0, excluded = '', cold = 1, closing = math.huge, top = 0}
    write_division(cap, d)
    redis.call('HDEL', cap.meta, unpack(FIGURES))
    cap.rolled = true
    return d
  end
  if may_lock and take_lock(cap, FORCES * cap.epoch) then return 'compute', d end
  return d  -- another replica is computing it: keep the one in force meanwhile
end

-- 1 when the cap's least recently written row is older than a stale one's can be (its
-- period STALE below, its window two below: the rows prune.lua drops), else 0. O(log n).
local function stale_rows(cap)
  local oldest = redis.call('ZRANGE', cap.seen, 0, 0, 'WITHSCORES')
  if #oldest == 0 then return 0 end
  local below = math.min((cap.period - STALE) * cap.period_len, cap.start - cap.window)
  if tonumber(oldest[2]) < below then return 1 end
  return 0
end

-- λ of the window before as the division in force knows it ("" when it was made in
-- another window: the hand-back works it out from the rows).
local function closing_of(d, c)
  if d == nil or math.floor(d.at / c.window) * c.window ~= c.start then return '' end
  return fmt(d.closing)
end
