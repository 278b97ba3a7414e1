-- admit/rows.lua: part 2 of the admit script (lua/admit/args.lua states its layout and
-- the order of the parts): the clock of a cap and a client's row at it.
-- KEYS: each cap's rows key (s.cap.rows): a client's row is the hash named by it, ':' and
-- the client (row_key; ROW_FIELD), read and written by load_row and save_row, and rows
-- written by an earlier version are fields <field>:<client> of the rows hash itself; and
-- the cap's seen sorted set (the client at now, save_row).
-- ARGV: none (args.lua parsed it).
-- Reads: ROW ROW_FIELD ALPHA STALE LEAD (contract), NONE OPEN HELD num fmt (args.lua).
-- Defines: left elapsed into (core/sharing.Clock); fresh_row row_key load_row save_row fold
-- predicted want part (core/sharing.py).

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
  row.window, row.period, row.epoch, row.previous, row.page, row.first = -1, -1, -1, -1, -1, -1
  row.booked = -1
  row.kind = NONE
  row.limit, row.weight = limit, weight
  return row
end

-- A client's row is its own hash (row_key: the cap's rows key, ':' and the client, in the
-- cap's slot), small (a listpack) and with its own TTL: no command works on one hash of
-- every client, and no expiry frees one. A row an earlier version wrote into the cap's rows
-- hash (<field>:<client>) is read from there when the client has none of its own, and
-- moved out of it when saved (s.legacy).
local function row_key(cap, client)
  return cap.rows .. ':' .. client
end

local function legacy_fields(client)
  local fields = {}
  for i, f in ipairs(ROW) do fields[i] = ROW_FIELD[f] .. ':' .. client end
  return fields
end

local function load_row(s)
  local v = redis.call('HMGET', row_key(s.cap, s.client), unpack(ROW_NAMES))
  if v[1] == false then
    v = redis.call('HMGET', s.cap.rows, unpack(legacy_fields(s.client)))
    if v[1] == false then return fresh_row(s.limit, s.weight) end
    s.legacy = true
  end
  local row = {}
  for i = 1, #ROW do row[ROW[i]] = num(v[i] or '0') end
  row.limit, row.weight = s.limit, s.weight
  return row
end

local function save_row(s, row)
  local key, args = row_key(s.cap, s.client), {}
  for i = 1, #ROW do
    args[2 * i - 1], args[2 * i] = ROW_NAMES[i], fmt(row[ROW[i]])
  end
  redis.call('HSET', key, unpack(args))
  redis.call('PEXPIRE', key, s.cap.row_keep)
  if s.legacy then
    redis.call('HDEL', s.cap.rows, unpack(legacy_fields(s.client)))
    s.legacy = false
  end
  redis.call('ZADD', s.cap.seen, 'GT', fmt(now), s.client)
  redis.call('PEXPIRE', s.cap.seen, s.cap.row_keep)
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
      carried = math.fmod(share + row.credit - row.admitted, 1)
    end
    row.credit = carried
    row.admitted, row.asked = 0, 0
    row.window = c.start
  end
end

local function predicted(row, c)
  if row.previous < 0 then
    -- gone quiet in this window (longer than it asked, a period, and the gap its rate
    -- predicts between hits): predicted nothing more (core/sharing.py _quiet)
    if row.window == c.start and row.first >= c.start and row.asked > 0
        and c.now - row.seen > row.seen - row.first + c.period_len
          + (c.now - c.start) / row.asked then
      return 0
    end
    return row.asked / math.max(1, (c.now - c.start) / c.period_len)
  end
  local previous = row.previous
  -- a page the window before, booked for a later one (core/sharing.py _back)
  if previous > 0 and 1 < row.gap and row.gap <= STALE and row.page == c.start - c.window then
    previous = 0
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
  return (row.asked + previous * inside) * c.period_len / c.window
end

local function want(row, c, extra)
  local fixed, rate = row.asked + extra, predicted(row, c)
  -- it comes every window: as in the window before (core/sharing.py want)
  if row.gap == 1 and row.previous >= 0 and c.window == c.period_len then
    if row.previous_last + LEAD * c.period_len > c.now - c.window then
      if fixed <= row.previous then fixed, rate = row.previous, 0 end
    elseif row.asked >= row.previous then
      rate = 0
    end
  elseif c.window == c.period_len and row.booked == c.start then
    rate = 0  -- its page of this window, booked for it (core/sharing.py _paging)
  end
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
