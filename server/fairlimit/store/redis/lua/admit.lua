-- admit.lua: the all-or-nothing admission of one slot group of a plan, with the division
-- hand-back (core/admission.py and core/sharing.py state the rule, store/memory.py is the
-- reference; store/redis/store.py calls this by EVALSHA, store/redis/script.py builds the
-- arguments and prepends the constants and the ROW and DIVISION field tables it generates
-- from core/sharing.py, so neither is a hand-kept copy).
--
-- The layout (script.ADMIT states it too; tests/store/test_redis_script.py checks both agree):
-- KEYS  per counter: counter
-- KEYS  per cap: meta rows lock
-- ARGV  head: now may_lock lock_ms consumer want
-- ARGV  per counter: limit window hits shadow force kind extra
-- ARGV  per cap: period window capacity declared cap total given_epoch given_division f_u f_a f_l f_j f_t f_s
-- ARGV  per share: cap_index client limit weight hits shadow sized below_counters below_shares force parent nested
-- KEYS are the counter keys, then each cap's keys; ARGV is the head, then for counters,
-- caps and shares in turn: their number, then that many rows.
--
-- counter  hash: s = window start, n = count in that window (kind "" or "c"); for
--          kind "s" p<k> = "<index>:<hits>" of sub-window slot k; for kind "g" t = its tat
-- meta     hash: the division (DIVISION names its fields), cap, declared, the last
--          period's fairness figures f_* and the light demand (LIGHT_FIELD)
-- rows     hash: per client the fields of core/sharing.Row as <field>:<client> (ROW)
-- lock     string: the division epoch a replica is computing
-- now ("" = Redis TIME), may_lock, shadow, sized, force and nested "1" | "0"; total is the
-- 1-based index of the cap's own counter (0: not in this group); given_epoch "" = no
-- division given, else given_division is the division's values in DIVISION order, ","
-- separated; cap_index is 1-based into the caps; below_counters / below_shares list 1-based
-- indexes ("," separated) of the levels below the share in its descriptor (the cap sees
-- the request as demand when they admit); parent is the 1-based index of the share one cap
-- above (0: none in this group): a nested cap divides at most the parent's share.
-- consumer names the calling process; want > 0 asks for a lease block of that many hits
-- (core/lease.py states the rule): an admitted request then also reserves b <= want more
-- hits at every level, the least of each counter's (limit - count - hits) / (2 x holders)
-- (holders: the consumers holding a block of it in this window, its L:<consumer> fields)
-- and each cap's min(bound, wanted) - admitted - hits (wanted: the client's want with this
-- request, core/sharing.want), none at a cap not sized for its clients that holds a client
-- back or has no history yet; the reserved hits count as the client's demand at the cap too (release.lua
-- with demand = 1 gives back what is not used).
-- kind: "" an epoch-aligned fixed window of window seconds; "c" a calendar window, extra
-- its boundaries around the caller's now, "," separated (this call picks the window that
-- holds its own now); "s" a sliding window of SLIDING_PARTS sub-windows; "g" GCRA, extra
-- its burst (core/smooth.py states both). A block is never reserved at "s" or "g".
-- Returns {1 | 0, now, counts, admitted, bounds, rolled, block, wanted, full} (1 = charged,
--       0 = nothing charged; bounds and wanted as strings; rolled = indexes of caps whose
--       division this call wrote; block = the hits reserved, 0 = none; wanted = each
--       share's want, only when a block was asked for; full and was = per counter when it
--       is full again after this call and before it, for kinds "s" and "g", else "0"), or
--       {2, now, {cap index, epoch, fields, asker, extra, closing, in_force}...} when
--       this call won the lock of a cap whose division is due (asker "") or that a request
--       found newly contended (asker = its client, extra = its hits); fields is HLEN of the
--       cap's rows (the caller reads them with HSCAN, in bounded steps: no call returns or
--       walks every row); closing is λ of the window before when the division in force
--       knows it, else ""; in_force 1 when a division is in force: nothing was recorded
--       or charged; divide and call again with it, or (a large cap) call again without
--       it: the lock held, the division in force decides meanwhile.
-- ARGV tail, only for a request that reserves (store/redis/reservations.py): the number of
-- records, then per record its hits, max_duration in ms and its own counter's 1-based
-- index; their keys follow the caps' in KEYS. A record still open (not settled, not past its expiry) refuses the call at
-- once: {3, now}, nothing recorded or charged (two requests by one id would settle each
-- other's reservation). Admitted, each is kept as "<hits>|<now>|<expiry>" for settle.lua
-- (replacing a settled one), and its hits are added to its own counter's field r (the hits
-- of this window's reservations not settled; settle.lua takes them off; a new window's
-- count starts without it).
-- Every key written gets a TTL. Floats cross the boundary as %.17g strings, so Lua and
-- Python see the same doubles; every formula below is core/sharing.py's, in its order.

local COUNTER_ARGS, CAP_ARGS, SHARE_ARGS, CAP_KEYS = 7, 14, 12, 3

-- A key outlives its window by a second; with the caller's clock (tests, simulations) TTLs
-- still run on Redis's own clock, so a slow run must not see a window's counter expire
-- before its simulated end: a minute of slack then.
local SLACK_MS = ARGV[1] == '' and 1000 or 60000
local FIGURES = {'f_u', 'f_a', 'f_l', 'f_j', 'f_t', 'f_s'}
local NONE, OPEN, HELD = 0, 1, 2

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
  for x in string.gmatch(s, '[^,]+') do table.insert(out, x) end
  return out
end

local may_lock, lock_ms = ARGV[2] == '1', ARGV[3]
local holder, want_block = 'L:' .. ARGV[4], tonumber(ARGV[5])
local now = clock(ARGV[1])  -- clock.lua

local a = 6
local counters, caps, shares = {}, {}, {}
-- The calendar window of the boundaries given that holds now (the last one if none does).
local function calendar(extra)
  local b = list(extra)
  for k = 1, #b - 1 do
    if now < tonumber(b[k + 1]) then return tonumber(b[k]), tonumber(b[k + 1]) end
  end
  return tonumber(b[#b - 1]), tonumber(b[#b])
end

for i = 1, tonumber(ARGV[a]) do
  local w, kind = tonumber(ARGV[a + 2]), ARGV[a + 6]
  local start = math.floor(now / w) * w
  local finish = start + w
  if kind == 'c' then start, finish = calendar(ARGV[a + 7]) end
  counters[i] = {key = KEYS[i], limit = tonumber(ARGV[a + 1]), hits = tonumber(ARGV[a + 3]),
    shadow = ARGV[a + 4] == '1', force = ARGV[a + 5] == '1', ws = whole(start),
    ttl = (finish - now) * 1000 + SLACK_MS, window = w, kind = kind,
    meter = kind == 's' or kind == 'g', burst = tonumber(ARGV[a + 7]) or 0}
  a = a + COUNTER_ARGS
end
a = a + 1
local n = #counters
for j = 1, tonumber(ARGV[a]) do
  local b = n + (j - 1) * CAP_KEYS
  local period, w = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local figures = {}
  for f = 1, 6 do figures[f] = ARGV[a + 8 + f] end
  local start = math.floor(now / w) * w
  caps[j] = {meta = KEYS[b + 1], rows = KEYS[b + 2], lock = KEYS[b + 3],
    -- core/sharing.Clock
    period_len = period, window = w, now = now, period = math.floor(now / period),
    epoch = math.floor(now * SPLIT / period), start = start, finish = start + w,
    capacity = tonumber(ARGV[a + 3]), declared = tonumber(ARGV[a + 4]), name = ARGV[a + 5],
    total = tonumber(ARGV[a + 6]), given_e = ARGV[a + 7], given = ARGV[a + 8],
    figures = figures, keep = math.max(2 * w + 1, STALE * period) * 1000}
  a = a + CAP_ARGS
end
a = a + 1
for i = 1, tonumber(ARGV[a]) do
  local below_c, below_s = {}, {}
  for _, x in ipairs(list(ARGV[a + 8])) do table.insert(below_c, tonumber(x)) end
  for _, x in ipairs(list(ARGV[a + 9])) do table.insert(below_s, tonumber(x)) end
  shares[i] = {cap = caps[tonumber(ARGV[a + 1])], client = ARGV[a + 2],
    limit = num(ARGV[a + 3]), weight = tonumber(ARGV[a + 4]), hits = tonumber(ARGV[a + 5]),
    shadow = ARGV[a + 6] == '1', sized = ARGV[a + 7] == '1', below_c = below_c,
    below_s = below_s, force = ARGV[a + 10] == '1', parent = tonumber(ARGV[a + 11]),
    nested = ARGV[a + 12] == '1'}
  a = a + SHARE_ARGS
end

local records = {}
if ARGV[a + 1] then
  local first = n + #caps * CAP_KEYS
  for r = 1, tonumber(ARGV[a + 1]) do
    records[r] = {key = KEYS[first + r], hits = ARGV[a + 3 * r - 1], ttl = ARGV[a + 3 * r],
      counter = tonumber(ARGV[a + 3 * r + 1])}
    local held = redis.call('GET', records[r].key)
    if held and held ~= 'settled' then
      local expiry = tonumber(string.match(held, '[^|]+|[^|]+|([^|]+)'))
      if expiry and now < expiry then return {RESERVATION_OPEN, fmt(now)} end
    end
  end
end

-- --- the clock (core/sharing.Clock) ---------------------------------------------------------

local function left(c)
  return (c.finish - c.now) / c.period_len
end

local function elapsed(c)
  return math.min(1, (c.now - c.start + LEAD * c.period_len) / c.window)
end

local function into(c)
  return (c.now - c.period * c.period_len) / c.period_len + LEAD
end

-- --- rows (core/sharing.py: fold, predicted, want, part) ------------------------------------

local function fresh_row(limit, weight)
  local row = {}
  for _, f in ipairs(ROW) do row[f] = 0 end
  row.window, row.period, row.epoch, row.previous, row.page = -1, -1, -1, -1, -1
  row.kind = NONE
  row.limit, row.weight = limit, weight
  return row
end

local function load_row(s)
  local fields = {}
  for i, f in ipairs(ROW) do fields[i] = ROW_FIELD[f] .. ':' .. s.client end
  local v = redis.call('HMGET', s.cap.rows, unpack(fields))
  if v[1] == false then return fresh_row(s.limit, s.weight) end
  local row = {}
  for i, f in ipairs(ROW) do row[f] = num(v[i] or '0') end
  row.limit, row.weight = s.limit, s.weight
  return row
end

local function save_row(s, row)
  local args = {}
  for _, f in ipairs(ROW) do
    table.insert(args, ROW_FIELD[f] .. ':' .. s.client)
    table.insert(args, fmt(row[f]))
  end
  redis.call('HSET', s.cap.rows, unpack(args))
  redis.call('PEXPIRE', s.cap.rows, s.cap.keep)
end

local function fold(row, c, closing)
  if row.period < c.period then
    local gap = c.period - row.period
    if gap > STALE then
      row.history, row.mass, row.last_asked, row.last_admitted = 0, 0, 0, 0
    elseif row.period >= 0 then
      if gap == 1 then
        row.last_asked, row.last_admitted = row.period_asked, row.period_admitted
      else
        row.last_asked, row.last_admitted = 0, 0
      end
      local keep = 1 - ALPHA
      local decay = keep ^ (gap - 1)
      local total = (ALPHA * row.period_asked + keep * row.history * row.mass) * decay
      row.mass = 1 - (1 - (ALPHA + keep * row.mass)) * decay
      row.history = total / row.mass
    end
    row.period_asked, row.period_admitted = 0, 0
    row.period = c.period
  end
  if row.window ~= c.start then
    local carried = 0
    local follows = row.window == c.start - c.window
    if follows then row.previous = row.asked else row.previous = -1 end
    row.previous_last = row.seen
    if row.asked > row.admitted and follows then
      local share = math.min(row.asked, row.limit, closing * row.weight)
      local left_over = share + row.credit - row.admitted
      if 0 < left_over and left_over < 1 then carried = left_over end
    end
    row.credit = carried
    row.admitted, row.asked = 0, 0
    row.window = c.start
  end
end

local function predicted(row, c)
  if row.previous < 0 then
    return row.asked / math.max(1, (c.now - c.start) / c.period_len)
  end
  local since = c.now - c.window
  local inside = 0
  if row.previous_last > since then
    local spread = row.previous_last - (c.start - c.window)
    if spread > 0 then
      inside = math.min(1, (row.previous_last - since) / spread)
    else
      inside = 1
    end
  end
  return (row.asked + row.previous * inside) * c.period_len / c.window
end

local function want(row, c, extra)
  local fixed, rate = row.asked + extra, predicted(row, c)
  if fixed + rate * left(c) > row.limit then return row.limit, 0 end
  return fixed, rate
end

local function part(row, c, level)
  local fixed, rate = want(row, c, 0)
  local wanted = fixed + rate * left(c)
  if wanted <= 0 then return NONE, 0, 0 end
  if wanted > level * row.weight then return HELD, 0, 0 end
  return OPEN, fixed, rate
end

-- --- the division (core/sharing.py: Division, leave, enter, stale_division) ----------------

local function load_division(cap)
  local names = {}
  for i, f in ipairs(DIVISION) do names[i] = DIVISION_FIELD[f] end
  local v = redis.call('HMGET', cap.meta, unpack(names))
  if v[1] == false then return nil end
  local d = {}
  for i, f in ipairs(DIVISION) do
    if f == 'excluded' then d[f] = v[i] or '' else d[f] = num(v[i] or '0') end
  end
  return d
end

local function write_division(cap, d)
  local args = {}
  for _, f in ipairs(DIVISION) do
    table.insert(args, DIVISION_FIELD[f])
    if f == 'excluded' then table.insert(args, d[f]) else table.insert(args, fmt(d[f])) end
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
  if redis.call('EXISTS', cap.rows) == 0 then
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

-- λ of the window before as the division in force knows it ("" when it was made in
-- another window: the hand-back works it out from the rows).
local function closing_of(d, c)
  if d == nil or math.floor(d.at / c.window) * c.window ~= c.start then return '' end
  return fmt(d.closing)
end

-- --- the verdict (core/sharing.py: contended, verdict, _cold) -------------------------------

local function contended(d, row, s, capacity)
  if d.held > 0 or d.forced >= FORCES - 1 then return false end
  if d.forced ~= 0 and d.asks * AMORTISE < d.rows then return false end
  local fixed, rate = want(row, s.cap, math.max(s.hits, 1))
  local wanted = fixed + rate * left(s.cap)
  local room = capacity - d.fixed - d.rate * left(s.cap)
  return wanted > room + EPSILON and d.top > room / row.weight + EPSILON
end

local function cold(bound, d, row, s, capacity, total)
  if d.cold == 0 or s.sized then return bound end
  local split = capacity * row.weight / math.max(s.cap.declared, d.rows + 1)
  local paced = capacity * elapsed(s.cap) - (total - row.admitted)
  return math.min(bound, math.max(split, paced, 1))
end

-- core/sharing._bursting
local function bursting(row, share, c)
  if row.history * c.window / c.period_len >= share then return false end
  return row.period_asked > BURST * row.history * into(c)
end

-- core/sharing._for_light: (part, kept)
local function for_light(share, row, d, s)
  if s.reserve <= 0 then return 0, 0 end
  local c = s.cap
  local part = s.reserve * row.weight / (d.held + row.weight)
  local coming = row.history * math.min(math.max(0, left(c) - RELEASE), 1)
  local margin = coming - math.min(share * (1 - elapsed(c)), coming)
  if part < margin then return part, part end
  return part, margin
end

-- core/sharing._paced
local function paced(share, row, d, s, capacity, total)
  local c = s.cap
  local held_back, part, kept = 0, 0, 0
  if not s.sized then
    if d.cold ~= 0 then
      held_back = share * (1 - elapsed(c))
    elseif not s.nested and not bursting(row, share, c) then
      part, kept = for_light(share, row, d, s)
      share = share - kept
      held_back = math.min(share * (1 - elapsed(c)), row.history * left(c))
    end
  end
  local bound = share - held_back
  if held_back ~= 0 and row.admitted + 1 <= math.max(bound, 1) then
    bound = math.max(bound, math.min(share, row.admitted + math.max(s.hits, 1)))
  end
  if kept ~= 0 and kept >= part then
    bound = math.min(bound, row.admitted + capacity - total - s.reserve)
  end
  return cold(bound, d, row, s, capacity, total)
end

-- (bound, share, kind, light)
local function verdict(row, d, s, capacity, total)
  local c = s.cap
  local h = math.max(s.hits, 1)
  local fixed, rate = want(row, c, h)
  local l = left(c)
  local wanted = fixed + rate * l
  local coming = math.floor(d.rate * l + EPSILON)
  local room = math.max(0, capacity - d.fixed - coming)
  if wanted * (d.held + row.weight) <= room * row.weight + EPSILON then
    local share = s.limit
    if d.held > 0 then
      share = math.min(share, (room - wanted) / d.held * row.weight)
    end
    if rate ~= 0 or fixed < s.limit or d.cold ~= 0 or room - wanted >= 1 then
      return cold(share, d, row, s, capacity, total), share, OPEN, fixed < s.limit
    end
    return paced(share, row, d, s, capacity, total), share, HELD, false
  end
  local share = room * row.weight / (d.held + row.weight)
  return paced(share + row.credit, row, d, s, capacity, total), share + row.credit, HELD, false
end

-- --- light demand (core/sharing.py: Light, roll_light, schedule, reserve) -----------------

local function load_light(cap)
  local v = redis.call('HMGET', cap.meta, LIGHT_FIELD.window, LIGHT_FIELD.asked,
    LIGHT_FIELD.expected)
  local light = {window = -1, asked = 0, expected = 0}
  if v[1] then light.window, light.asked, light.expected = num(v[1]), num(v[2]), num(v[3]) end
  if light.window ~= cap.start then
    -- the calendar's entry for this window, and those of windows nobody asked in
    local field = CALENDAR .. whole(cap.start)
    local expected = num(redis.call('HGET', cap.meta, field) or '0')
    redis.call('HDEL', cap.meta, field)
    if light.window >= 0 and (cap.start - light.window) / cap.window <= STALE then
      for at = light.window + cap.window, cap.start - cap.window, cap.window do
        redis.call('HDEL', cap.meta, CALENDAR .. whole(at))
      end
    end
    light.window, light.asked, light.expected = cap.start, 0, expected
  end
  return light
end

-- core/sharing.schedule: the window start the client is expected back in (-1: none)
local function schedule(row, c)
  if row.page ~= c.start then
    if row.page >= 0 then row.gap = (c.start - row.page) / c.window end
    row.page = c.start
  end
  if 1 < row.gap and row.gap <= STALE then return c.start + row.gap * c.window end
  return -1
end

local function reserve(light, d, c)
  if d.cold ~= 0 then return 0 end
  local coming = math.floor(d.rate * left(c) + EPSILON)
  return math.max(0, math.floor(light.expected - light.asked + EPSILON) - coming)
end

-- --- sliding windows and GCRA (core/smooth.py) ---------------------------------------------

local function part_of(c)
  return math.floor(now * SLIDING_PARTS / c.window)
end

-- The count of a sliding window or a GCRA bucket (c.state keeps what was read).
local function meter_count(c)
  if c.kind == 'g' then
    c.tat = tonumber(redis.call('HGET', c.key, 't') or '0')
    if c.limit == 0 then return 0 end
    local used = math.max(0, c.tat - now) / (c.window / c.limit)
    return c.limit - (c.burst + 1) + math.ceil(used - SMOOTH_EPSILON)
  end
  local fields = {}
  for k = 0, SLIDING_PARTS do fields[k + 1] = 'p' .. k end
  local held = redis.call('HMGET', c.key, unpack(fields))
  local newest, total = part_of(c), 0
  c.parts = {}
  for k = 0, SLIDING_PARTS do
    local index, hits = -1, 0
    if held[k + 1] then
      local colon = string.find(held[k + 1], ':', 1, true)
      index = tonumber(string.sub(held[k + 1], 1, colon - 1))
      hits = tonumber(string.sub(held[k + 1], colon + 1))
    end
    c.parts[k] = {index, hits}
    if newest - SLIDING_PARTS <= index and index <= newest then total = total + hits end
  end
  return total
end

-- Charge hits to a meter; then c.full is when it counts nothing any more.
local function meter_charge(c, hits)
  if c.kind == 'g' then
    if c.limit ~= 0 and hits ~= 0 then
      c.tat = math.max(c.tat, now) + hits * (c.window / c.limit)
      redis.call('HSET', c.key, 't', fmt(c.tat))
    end
    return
  end
  local index = part_of(c)
  local k = index % (SLIDING_PARTS + 1)
  local slot = c.parts[k]
  if slot[1] ~= index then slot[1], slot[2] = index, 0 end
  slot[2] = slot[2] + hits
  redis.call('HSET', c.key, 'p' .. k, whole(index) .. ':' .. whole(slot[2]))
end

local function meter_full(c)
  if c.kind == 'g' then return c.tat end
  local newest = -1
  for k = 0, SLIDING_PARTS do
    if c.parts[k][2] > 0 and c.parts[k][1] > newest then newest = c.parts[k][1] end
  end
  if newest < 0 then return 0 end
  return (newest + SLIDING_PARTS + 1) * c.window / SLIDING_PARTS
end

-- --- the decision ---------------------------------------------------------------------------

local need = {}
for j, cap in ipairs(caps) do
  local d, held = division_of(cap)
  if d == 'compute' then
    table.insert(need, {j, whole(FORCES * cap.epoch), redis.call('HLEN', cap.rows), '', '0',
      closing_of(held, cap), held and 1 or 0})
  end
  cap.division = d
end
if #need > 0 then return {2, fmt(now), need} end

for _, s in ipairs(shares) do
  s.d = s.cap.division
  s.row = load_row(s)
  fold(s.row, s.cap, s.d.closing)
  leave(s.d, s.row, s)
  -- the forced-th remake of this sub-period (core/sharing.divide, store/memory._claims)
  local forced = s.d.forced + 1
  if math.floor(s.d.epoch / FORCES) ~= s.cap.epoch then forced = 1 end
  local id = FORCES * s.cap.epoch + forced
  if contended(s.d, s.row, s, s.cap.capacity) and may_lock and take_lock(s.cap, id) then
    local extra = math.max(s.hits, 1)
    table.insert(need, {0, whole(id), redis.call('HLEN', s.cap.rows),
      s.client, whole(extra), closing_of(s.d, s.cap), 1})
    for j, cap in ipairs(caps) do
      if cap == s.cap then need[#need][1] = j end
    end
    return {2, fmt(now), need}
  end
  s.d.asks = s.d.asks + math.max(s.hits, 1)
end

local admitted = true
local counts, shared, bounds, rolled, wanted, was = {}, {}, {}, {}, {}, {}
for i, c in ipairs(counters) do
  if c.meter then
    counts[i] = meter_count(c)
    was[i] = fmt(meter_full(c))
  else
    was[i] = '0'
    local held = redis.call('HMGET', c.key, 's', 'n')
    c.current = held[1] == c.ws
    counts[i] = c.current and tonumber(held[2]) or 0
  end
  c.over = not c.shadow and counts[i] + math.max(c.hits, 1) > c.limit
  if c.over then admitted = false end
end
for i, s in ipairs(shares) do
  local total = s.cap.total > 0 and counts[s.cap.total] or 0
  local capacity = s.cap.capacity
  if s.parent > 0 and s.parent < i then capacity = math.min(capacity, shares[s.parent].share) end
  if s.cap.light == nil then s.cap.light = load_light(s.cap) end
  s.reserve = reserve(s.cap.light, s.d, s.cap)
  local bound, share, kind, light = verdict(s.row, s.d, s, capacity, total)
  s.share, s.kind, s.bound, s.light = share, kind, bound, light
  if want_block > 0 then  -- its want with this request: a block stays within it
    local f, r = want(s.row, s.cap, math.max(s.hits, 1))
    s.wanted = f + r * left(s.cap)
    wanted[i] = fmt(s.wanted)
  end
  shared[i] = s.row.admitted
  bounds[i] = fmt(bound)
  s.over = not s.shadow and shared[i] + math.max(s.hits, 1) > bound + EPSILON
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
  if below or admitted then
    s.row.asked = s.row.asked + s.hits
    s.row.period_asked = s.row.period_asked + s.hits
    s.row.seen = now
    if s.light and s.d.cold == 0 then
      s.cap.light.asked = s.cap.light.asked + s.hits
      local at = schedule(s.row, s.cap)
      if at >= 0 then redis.call('HINCRBYFLOAT', s.cap.meta, CALENDAR .. whole(at), s.hits) end
    end
  end
end

-- The lease block (core/lease.size): admitted requests only.
local block = 0
if admitted and want_block > 0 then
  block = want_block
  for _, c in ipairs(counters) do
    if c.meter then block = 0 end  -- a sliding or GCRA count moves with time alone
  end
  for i, c in ipairs(counters) do
    local holders = 1
    if c.current then
      local fields = redis.call('HGETALL', c.key)
      for k = 1, #fields, 2 do
        local f = fields[k]
        if f ~= holder and string.sub(f, 1, 2) == 'L:' and fields[k + 1] == c.ws then
          holders = holders + 1
        end
      end
    end
    block = math.min(block, (c.limit - counts[i] - c.hits) / (2 * holders))
  end
  for i, s in ipairs(shares) do
    if not s.sized and (s.kind ~= OPEN or s.d.held > 0 or s.d.cold ~= 0) then
      block = 0  -- a contended cap (or one without history) is divided request by request
    else
      block = math.min(block, math.min(s.bound, s.wanted) - shared[i] - s.hits + EPSILON)
    end
  end
  block = math.floor(block)
  if block < 1 then block = 0 end
end

-- Refused, only the levels of charge_when_over_limit rules are charged; admitted, all.
local full = {}
for i, c in ipairs(counters) do
  local add = c.hits + block
  if c.meter then
    if add ~= 0 and (admitted or c.force) then meter_charge(c, add) end
    local at = meter_full(c)
    full[i] = fmt(at)
    if at > now then
      redis.call('PEXPIRE', c.key, math.ceil((at - now) * 1000 + SLACK_MS))
    end
  elseif add ~= 0 and (admitted or c.force) then
    full[i] = '0'
    if c.current then
      redis.call('HINCRBY', c.key, 'n', add)
    else
      redis.call('HSET', c.key, 's', c.ws, 'n', add)
      redis.call('HDEL', c.key, 'r')
      redis.call('PEXPIRE', c.key, math.ceil(c.ttl))
    end
  else
    full[i] = '0'
  end
  if block > 0 then redis.call('HSET', c.key, holder, c.ws) end
end
for _, s in ipairs(shares) do
  if admitted or s.force then
    s.row.admitted = s.row.admitted + s.hits + block
    s.row.period_admitted = s.row.period_admitted + s.hits + block
  end
  if block > 0 then  -- reserved, so counted as demand (release.lua takes back the unused)
    s.row.asked = s.row.asked + block
    s.row.period_asked = s.row.period_asked + block
  end
  enter(s.d, s.row, s.kind, s.cap)
end
for _, s in ipairs(shares) do save_row(s, s.row) end
for _, cap in ipairs(caps) do
  local d = cap.division
  redis.call('HSET', cap.meta, DIVISION_FIELD.held, fmt(d.held), DIVISION_FIELD.fixed,
    fmt(d.fixed), DIVISION_FIELD.rate, fmt(d.rate), DIVISION_FIELD.asks, fmt(d.asks),
    DIVISION_FIELD.top, fmt(d.top))
  local light = cap.light
  if light then
    redis.call('HSET', cap.meta, LIGHT_FIELD.window, fmt(light.window), LIGHT_FIELD.asked,
      fmt(light.asked), LIGHT_FIELD.expected, fmt(light.expected))
  end
  redis.call('PEXPIRE', cap.meta, cap.keep)
end
if admitted then
  for _, r in ipairs(records) do
    local expiry = fmt(now + tonumber(r.ttl) / 1000)
    redis.call('SET', r.key, r.hits .. '|' .. fmt(now) .. '|' .. expiry, 'PX',
      tonumber(r.ttl) + SLACK_MS)
    if not counters[r.counter].meter then
      redis.call('HINCRBY', counters[r.counter].key, 'r', r.hits)
    end
  end
end
return {admitted and 1 or 0, fmt(now), counts, shared, bounds, rolled, block, wanted, full, was}
