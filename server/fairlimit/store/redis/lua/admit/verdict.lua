-- admit/verdict.lua: part 4 of the admit script (lua/admit/args.lua states its layout and
-- the order of the parts): a share's bound under the division (contended, cold, paced,
-- verdict) and the light demand at a cap (load_light, schedule, reserve).
-- KEYS: each cap's meta hash (LIGHT_FIELD and the calendar's CALENDAR<start> fields).
-- ARGV: none.
-- Reads: FORCES AMORTISE EPSILON BURST RELEASE ROUNDING STALE LEAD ALPHA LIGHT_FIELD
-- CALENDAR (contract), num whole OPEN HELD (args.lua), want left elapsed into (rows.lua).
-- Defines: contended split cold cold_burst bursting for_light asked_by_now arrived unseen
-- paced in_page verdict load_light continues schedule reserve.

-- --- the verdict (core/sharing.py: contended, verdict, _cold) -------------------------------

local function contended(d, row, s, capacity)
  if d.held > 0 or d.forced >= FORCES - 1 then return false end
  if d.forced ~= 0 and d.asks * AMORTISE < d.rows then return false end
  local fixed, rate = want(row, s.cap, math.max(s.hits, 1))
  local wanted = fixed + rate * left(s.cap)
  local room = capacity - d.fixed - d.rate * left(s.cap)
  return wanted > room + EPSILON and d.top > room / row.weight + EPSILON
end

-- core/sharing._split
local function split(row, d, s, capacity)
  return capacity * row.weight / math.max(s.cap.declared, d.rows + 1)
end

local function cold(bound, d, row, s, capacity, total)
  if d.cold == 0 or s.sized then return bound end
  local paced = capacity * elapsed(s.cap) - (total - row.admitted)
  return math.min(bound, math.max(split(row, d, s, capacity), paced, 1))
end

-- core/sharing._cold_burst
local function cold_burst(row, d, s, capacity)
  if s.cap.window <= s.cap.period_len then return false end
  return row.period_asked > split(row, d, s, capacity)
end

-- core/sharing._bursting
local function bursting(row, share, c)
  local young = row.mass <= ALPHA + EPSILON and c.window <= c.period_len
  if young then return row.period_asked > BURST * row.history * (into(c) - LEAD) + 1 end
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

-- core/sharing._arrived
local function arrived(row, c)
  if c.window <= c.period_len then return false end
  if row.previous >= 0 and row.mass <= ALPHA + EPSILON then return true end
  if row.first < c.start then return false end
  return c.now - row.first < row.first - c.start
end

-- core/sharing._unseen
local function unseen(share, row, d, s)
  local count = s.cap.declared - d.rows
  if count <= 0 then return 0 end
  return share * count / (d.held + row.weight + count)
end

-- core/sharing._asked_by_now
local function asked_by_now(row, c)
  return row.previous >= 0 and row.previous_last <= c.now - c.window + LEAD * c.period_len
end

-- core/sharing._paced
-- coming: the open clients' requests still to come, whole, as verdict worked them out
local function paced(share, row, d, s, capacity, total, coming)
  local c = s.cap
  local held_back, part, kept = 0, 0, 0
  local eased = false
  if not s.sized then
    if d.cold ~= 0 then
      if not arrived(row, c) and not cold_burst(row, d, s, capacity) then
        held_back = share * (1 - elapsed(c))
      end
    elseif not s.nested and not bursting(row, share, c) then
      part, kept = for_light(share, row, d, s)
      share = share - kept
      held_back = math.min(share * (1 - elapsed(c)), row.history * left(c))
      if asked_by_now(row, c) then held_back = 0 end
      if arrived(row, c) then
        local kept_back = unseen(share, row, d, s)
        eased = kept_back < held_back
        held_back = math.min(held_back, kept_back)
      end
    end
  end
  local bound = share - held_back
  if held_back ~= 0 and row.admitted + 1 <= math.max(bound, 1) then
    bound = math.max(bound, math.min(share, row.admitted + math.max(s.hits, 1)))
  end
  local beside = capacity - total - coming
  if kept ~= 0 and kept >= part then
    bound = math.min(bound, row.admitted + beside - s.reserve)
  end
  if eased then
    bound = math.min(bound, row.admitted + beside)
  end
  local top = math.ceil(share - EPSILON)
  -- core/sharing._cold_rounding: nobody has history, the window's last LEAD, no open client due
  if bound < top and (row.history > 0 or (d.cold ~= 0 and elapsed(c) >= 1 and d.rate <= 0)) then
    local ahead = row.history * left(c)
    local phi = elapsed(c)
    if phi >= 1 or ahead < ROUNDING + 1 then
      local spare = math.floor(beside - s.reserve + EPSILON)
      local lag = 0
      if phi < 1 then lag = math.max(0, math.floor(ahead + EPSILON) - 1) end
      bound = math.max(bound, math.min(top - lag, row.admitted + spare))
    end
  end
  return cold(bound, d, row, s, capacity, total)
end

-- core/sharing._in_page: a held request, the rest of a page of a client come back windows
-- apart (light earlier in this window), is light all the same
local function in_page(row, c)
  return row.page == c.start and 1 < row.gap and row.gap <= STALE
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
    return paced(share, row, d, s, capacity, total, coming), share, HELD, in_page(row, c)
  end
  local share = room * row.weight / (d.held + row.weight)
  return paced(share + row.credit, row, d, s, capacity, total, coming), share + row.credit,
    HELD, in_page(row, c)
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

-- core/sharing._continues: the rest of a page begun in the window before, across the edge
local function continues(row, c)
  local lead = LEAD * c.period_len
  return row.page == c.start - c.window and row.gap ~= 1 and row.previous_last >= c.start - lead
    and c.now - row.previous_last <= 2 * lead
end

-- core/sharing.schedule: the window start the client is expected back in (-1: none)
local function schedule(row, c)
  if row.page ~= c.start and not continues(row, c) then
    row.booked = -1
    if row.page >= 0 then
      -- the booking made at its last page
      if 1 < row.gap and row.gap <= STALE then row.booked = row.page + row.gap * c.window end
      row.gap = (c.start - row.page) / c.window
    end
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
