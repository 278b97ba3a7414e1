-- settle.lua: settle one reservation of a token budget, once (core/reserve.py states the
-- rule; store/memory.py MemoryStore.settle is the reference; store/redis/reservations.py
-- builds the arguments; lua/admit/charge.lua keeps the record when it admits a reserving
-- request).
--
-- The layout (store/redis/reservations.py SETTLE states it too):
-- KEYS  per counter: counter
-- KEYS  per cap: rows
-- KEYS  last: the record
-- ARGV  head: now amount negative own
-- ARGV  per counter: window
-- ARGV  per cap: period window
-- ARGV  per share: cap_index client
-- A client's row is the hash <rows>:<client>, or, written by an earlier version, the
-- fields <field>:<client> of rows (row_at, lua/row_at.lua).
-- KEYS are the counter keys, each cap's rows key, then the record; ARGV is the head, then
-- for counters, caps and shares in turn: their number, then that many rows.
--
-- counter  hash: s = window start, n = count, r = hits of the window's reservations not
--          settled (admit/charge.lua adds them; the own counter's r loses this one's here)
-- record   string "<hits>|<at>|<expiry>" while open (at: the admission's clock, expiry: at
--          + max_duration, past which it counts as gone: the key's own TTL runs on Redis's
--          clock, with slack for a caller's clock), "settled" once settled.
-- The unused part (hits - amount, or with negative = "1" min(amount, hits)) goes back at
-- each counter and at each cap's row only while they still count the window (and period)
-- of at; a cost above the reservation is charged now as debt, over the limit or not. No
-- count goes below 0. Returns {found (1 | 0), refund, debt}.

local SLACK_MS = ARGV[1] == '' and 1000 or 60000
local now = clock(ARGV[1])  -- clock.lua

local function whole(x)
  return string.format('%.0f', x)
end

local function fmt(x)
  return string.format('%.17g', x)
end

local record = KEYS[#KEYS]
local held = redis.call('GET', record)
if not held or held == 'settled' then return {0, 0, 0} end
local parts = {}
for x in string.gmatch(held, '[^|]+') do table.insert(parts, tonumber(x)) end
local reserved, at, expiry = parts[1], parts[2], parts[3]
if now >= expiry then return {0, 0, 0} end
local amount, negative = tonumber(ARGV[2]), ARGV[3] == '1'
local refund, debt = 0, 0
if negative then
  refund = math.min(amount, reserved)
elseif amount < reserved then
  refund = reserved - amount
else
  debt = amount - reserved
end
redis.call('SET', record, 'settled', 'KEEPTTL')

local own = tonumber(ARGV[4])
local a = 5
local n = tonumber(ARGV[a])
for i = 1, n do
  local w = tonumber(ARGV[a + i])
  local c = redis.call('HMGET', KEYS[i], 's', 'n', 'r')
  local reserved_in = c[1] == whole(math.floor(at / w) * w)
  if refund > 0 and reserved_in then
    redis.call('HINCRBY', KEYS[i], 'n', -math.min(refund, tonumber(c[2]) or 0))
  end
  if i == own and reserved_in then  -- settled: no longer reserved (admit/charge.lua's r)
    redis.call('HINCRBY', KEYS[i], 'r', -math.min(reserved, tonumber(c[3]) or 0))
  end
  if debt > 0 then
    local start = math.floor(now / w) * w
    if redis.call('HGET', KEYS[i], 's') == whole(start) then
      redis.call('HINCRBY', KEYS[i], 'n', debt)
    else
      redis.call('HSET', KEYS[i], 's', whole(start), 'n', debt)
      redis.call('HDEL', KEYS[i], 'r')
      redis.call('PEXPIRE', KEYS[i], math.ceil((start + w - now) * 1000 + SLACK_MS))
    end
  end
end
a = a + n + 1
local caps = {}
for j = 1, tonumber(ARGV[a]) do
  caps[j] = {rows = KEYS[n + j], period = tonumber(ARGV[a + 2 * j - 1]),
    window = tonumber(ARGV[a + 2 * j])}
end
a = a + 2 * #caps + 1

local function add(key, field, by)
  local v = redis.call('HGET', key, field)
  if v then redis.call('HSET', key, field, fmt(math.max(0, tonumber(v) + by))) end
end

-- A client's hits at a cap, moved by hits: admitted where its row counts the window and
-- period of t (when they were charged), asked where it counts those of now
-- (store/memory._settle_row).
local function move(cap, client, t, hits)
  if hits == 0 then return end
  local key, of, v = row_at(cap.rows, client)
  local ws, p = tonumber(v[1] or ''), tonumber(v[2] or '')
  if ws == math.floor(t / cap.window) * cap.window then
    add(key, ROW_FIELD.admitted .. of, hits)
  end
  if p == math.floor(t / cap.period) then
    add(key, ROW_FIELD.period_admitted .. of, hits)
  end
  if ws == math.floor(now / cap.window) * cap.window then
    add(key, ROW_FIELD.asked .. of, hits)
  end
  if p == math.floor(now / cap.period) then
    add(key, ROW_FIELD.period_asked .. of, hits)
  end
end

for i = 1, tonumber(ARGV[a]) do
  local cap, client = caps[tonumber(ARGV[a + 2 * i - 1])], ARGV[a + 2 * i]
  move(cap, client, at, -refund)
  move(cap, client, now, debt)
end
return {1, refund, debt}
