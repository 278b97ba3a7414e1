-- admit/decide.lua: part 6 of the admit script (lua/admit/args.lua states its layout and
-- the order of the parts), where its body goes on: the divisions in force (or a hand-back,
-- {2, ...}), each share's row folded and left out of its division (or a hand-back when it
-- finds the cap contended), the counters' counts and the shares' bounds, so whether the
-- request is admitted, and the demand each cap sees.
-- KEYS: counters (HMGET s n), each cap's rows (HLEN of an earlier version's rows hash, for
-- a hand-back) and seen (ZCARD and its first), meta (calendar).
-- ARGV: none.
-- Reads: FORCES EPSILON CALENDAR (contract), caps shares counters may_lock want_block
-- now fmt whole (args.lua) and the functions of rows.lua, division.lua, verdict.lua and
-- meters.lua.
-- Defines: need admitted counts shared bounds rolled wanted was; per cap cap.division
-- cap.light (cap.rolled: division_of); per share s.d s.row s.share s.kind s.bound s.light
-- s.reserve s.wanted s.over; per counter c.current c.over (a meter: c.tat or c.parts).

-- --- the decision ---------------------------------------------------------------------------

local need = {}
for j, cap in ipairs(caps) do
  local d, held = division_of(cap)
  if d == 'compute' then
    table.insert(need, {j, whole(FORCES * cap.epoch), redis.call('HLEN', cap.rows), '', '0',
      closing_of(held, cap), held and 1 or 0, redis.call('ZCARD', cap.seen), stale_rows(cap)})
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
      s.client, whole(extra), closing_of(s.d, s.cap), 1, redis.call('ZCARD', s.cap.seen),
      stale_rows(s.cap)})
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
    if s.row.first < s.row.window then s.row.first = now end
    if s.light then  -- noted in its row; counted and booked unless the cap is cold
      local at = schedule(s.row, s.cap)
      if s.d.cold == 0 then
        s.cap.light.asked = s.cap.light.asked + s.hits
        if at >= 0 then redis.call('HINCRBYFLOAT', s.cap.meta, CALENDAR .. whole(at), s.hits) end
      end
    end
  end
end
