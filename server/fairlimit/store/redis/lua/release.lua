-- release.lua: undo what the admit script (lua/admit/) charged for one slot group of a
-- multi-slot request that another group refused (store/redis/store.py, the two-phase
-- admission across slots), or give back the unused hits of a lease block (core/lease.py;
-- demand = "1").
--
-- The layout (script.RELEASE states it too; tests/store/test_redis_script.py checks both agree):
-- KEYS  per counter: counter
-- KEYS  per cap: rows
-- ARGV  head: now demand
-- ARGV  per counter: window hits kind extra
-- ARGV  per cap: period window
-- ARGV  per share: cap_index client hits
-- A client's row is the hash <rows>:<client>, or, written by an earlier version, the
-- fields <field>:<client> of rows (row_at, lua/row_at.lua).
-- KEYS are the counter keys, then each cap's keys; ARGV is the head, then for counters,
-- caps and shares in turn: their number, then that many rows. Several such segments may
-- follow one another (KEYS and ARGV each in turn): a sweep gives back many blocks, and
-- counts refused hits owed, in one call per slot (core/lease.py).
--
-- now is the clock the admit script replied with, so the windows and the period are the
-- ones it charged; a count is decremented only while that window (or period) is still the
-- current one, as a later window starts from zero anyway. cap_index is 1-based into the
-- caps. The client's part in the division stays as the admit script left it. A refused
-- reservation's demand was real and stays (demand = "0"); a lease block's unused hits were
-- counted as demand when reserved and are taken out of it too (demand = "1").
-- kind and extra as the admit script's, but a GCRA counter's extra is its interval
-- (seconds a hit takes to come back): its tat moves back by hits x interval; a sliding
-- window's hits come off the sub-window of now.
-- Returns 1.

local COUNTER_ARGS, CAP_ARGS, SHARE_ARGS, CAP_KEYS = 4, 2, 3, 1

local function whole(x)
  return string.format('%.0f', x)
end

local function fmt(x)
  return string.format('%.17g', x)
end

local function add(key, field, by)
  local held = redis.call('HGET', key, field)
  if held then redis.call('HSET', key, field, fmt(tonumber(held) + by)) end
end

local now, demand  -- the segment's
local a, k = 1, 0  -- the segment's first ARGV; the KEYS of the segments before it
-- The start of the window that holds now: epoch-aligned, or of the calendar boundaries.
local function start_of(w, kind, extra)
  if kind ~= 'c' then return math.floor(now / w) * w end
  local b, at = {}, tonumber(string.match(extra, '^[^,]+'))
  for x in string.gmatch(extra, '[^,]+') do table.insert(b, tonumber(x)) end
  for k = 1, #b - 1 do
    if now >= b[k] and now < b[k + 1] then at = b[k] end
  end
  return at
end

local function unmeter(key, w, hits, kind, extra)
  if kind == 'g' then
    local tat = redis.call('HGET', key, 't')
    if tat then redis.call('HSET', key, 't', fmt(tonumber(tat) - hits * tonumber(extra))) end
    return
  end
  local index = math.floor(now * SLIDING_PARTS / w)
  local field = 'p' .. (index % (SLIDING_PARTS + 1))
  local held = redis.call('HGET', key, field)
  if held and string.sub(held, 1, string.find(held, ':', 1, true) - 1) == whole(index) then
    local n = tonumber(string.sub(held, string.find(held, ':', 1, true) + 1))
    redis.call('HSET', key, field, whole(index) .. ':' .. whole(n - hits))
  end
end

while ARGV[a] do
  now, demand = tonumber(ARGV[a]), ARGV[a + 1] == '1'
  a = a + 2
  local n = tonumber(ARGV[a])
  for i = 1, n do
    local w, hits = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local kind, extra = ARGV[a + 3], ARGV[a + 4]
    if hits ~= 0 and (kind == 's' or kind == 'g') then
      unmeter(KEYS[k + i], w, hits, kind, extra)
    elseif hits ~= 0 and redis.call('HGET', KEYS[k + i], 's') == whole(start_of(w, kind, extra)) then
      redis.call('HINCRBY', KEYS[k + i], 'n', -hits)
    end
    a = a + COUNTER_ARGS
  end
  a = a + 1
  local caps, m = {}, tonumber(ARGV[a])
  for j = 1, m do
    local period, w = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    caps[j] = {rows = KEYS[k + n + j], p = math.floor(now / period), ws = math.floor(now / w) * w}
    a = a + CAP_ARGS
  end
  a = a + 1
  for _ = 1, tonumber(ARGV[a]) do
    local cap, client, hits = caps[tonumber(ARGV[a + 1])], ARGV[a + 2], tonumber(ARGV[a + 3])
    local key, of, held = row_at(cap.rows, client)
    if hits ~= 0 and tonumber(held[1] or '') == cap.ws then
      add(key, ROW_FIELD.admitted .. of, -hits)
      if demand then add(key, ROW_FIELD.asked .. of, -hits) end
    end
    if hits ~= 0 and tonumber(held[2] or '') == cap.p then
      add(key, ROW_FIELD.period_admitted .. of, -hits)
      if demand then add(key, ROW_FIELD.period_asked .. of, -hits) end
    end
    a = a + SHARE_ARGS
  end
  a = a + 1
  k = k + n + m * CAP_KEYS
end
return 1
