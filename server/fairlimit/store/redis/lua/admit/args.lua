-- admit/args.lua: part 1 of the admit script, which script.py joins from the files of
-- lua/admit/ in the order of script.PARTS (args rows division verdict meters decide
-- lease charge) into one script, called once per slot group by EVALSHA: the all-or-nothing
-- admission of one slot group of a plan, with the division hand-back (core/admission.py
-- and core/sharing.py state the rule, store/memory.py is the reference; store/redis/store.py
-- calls it, store/redis/script.py builds the arguments and prepends clock.lua, the
-- constants and the ROW and DIVISION field tables it generates from core/sharing.py, so
-- neither is a hand-kept copy). The parts share one chunk: each file uses what the files
-- before it define, and the body runs from here through decide, lease and charge.
--
-- This part reads every KEYS and ARGV (the layout below). Defines, for the later parts:
-- num fmt whole list calendar (helpers), SLACK_MS MAX_TTL_MS FIGURES NONE OPEN HELD
-- (constants), may_lock lock_ms holder want_block now (the head), counters caps shares n
-- (the rows) and records (the ARGV tail); a record still open returns {3, now} here.
--
-- The layout (script.ADMIT states it too; tests/store/test_redis_script.py checks both agree):
-- KEYS  per counter: counter
-- KEYS  per cap: meta rows lock seen
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
-- rows     the prefix of each client's row: hash <rows>:<client>, the fields of
--          core/sharing.Row (ROW), its own TTL; not in KEYS (its name holds the client),
--          in the cap's slot by its hash tag. The rows key itself is the hash an earlier
--          version kept every row in (<field>:<client>): read when a client has no row of
--          its own, the row moved out when written (rows.lua)
-- lock     string: the division epoch a replica is computing
-- seen     sorted set: per client with a row, the latest now its row was written at (ZADD
--          GT), so a division reads only the rows written since a time (store/redis/
--          division.py: the others play no part in it) and prune.lua finds the stale ones
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
-- Returns one flat list, {1 | 0, now, block, n, k, r, w, then n counts, n full, n was,
--       k admitted, k bounds, r rolled, w wanted} (1 = charged, 0 = nothing charged; n, k
--       the counters and shares, r and w how many rolled and wanted follow; a nested
--       table would cost Redis a conversion of its own; bounds and wanted as strings;
--       rolled = indexes of caps whose division this call wrote; block = the hits
--       reserved, 0 = none; wanted = each share's want, only when a block was asked for;
--       full and was = per counter when it is full again after this call and before it,
--       for kinds "s" and "g", else "0"), or
--       {2, now, {cap index, epoch, fields, asker, extra, closing, in_force, indexed,
--       stale}...} when this call won the lock of a cap whose division is due (asker "")
--       or that a request found newly contended (asker = its client, extra = its hits);
--       fields is HLEN of the cap's rows hash (rows an earlier version kept there; 0 when
--       none is left); the caller reads the rows written lately, found by seen, in bounded
--       steps: no call returns or walks every row; closing is λ of the window before when the division in force
--       knows it, else ""; in_force 1 when a division is in force: nothing was recorded
--       or charged; divide and call again with it, or (a large cap) call again without
--       it: the lock held, the division in force decides meanwhile; indexed is ZCARD of
--       seen (fewer than the rows hash holds: rows written before seen was kept, read
--       whole); stale
--       1 when seen's first client was last written before a stale row's time (prune.lua).
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

local COUNTER_ARGS, CAP_ARGS, SHARE_ARGS, CAP_KEYS = 7, 14, 12, 4

-- A key outlives its window by a second; with the caller's clock (tests, simulations) TTLs
-- still run on Redis's own clock, so a slow run must not see a window's counter expire
-- before its simulated end: a minute of slack then.
local SLACK_MS = ARGV[1] == '' and 1000 or 60000
-- The longest TTL given (~2.85 million years, longer than any window): Redis reads a number
-- a script passes as its %.17g text, which has an exponent from 1e17 on, and PEXPIRE then
-- fails the whole call ("value is not an integer or out of range"). A GCRA bucket charged
-- far ahead (charge_when_over_limit, a hits_addend of 1e9 on a daily limit of 1) reached it.
local MAX_TTL_MS = 9e16
local FIGURES = {'f_u', 'f_a', 'f_l', 'f_j', 'f_t', 'f_s'}
local NONE, OPEN, HELD = 0, 1, 2

local function num(s)
  if s == 'inf' then return math.huge end
  return tonumber(s)
end

-- A whole number below 1e15 (not -0) is written as an integer's digits: the text %.17g
-- gives it, in less than half its time (a row is 23 numbers, most of them whole).
local function fmt(x)
  if x == math.floor(x) and x > -1e15 and x < 1e15 and (x ~= 0 or 1 / x > 0) then
    return string.format('%d', x)
  end
  if x == math.huge then return 'inf' end
  return string.format('%.17g', x)
end

local function whole(x)
  return string.format('%.0f', x)
end

local function list(s)
  local out = {}
  if s == '' then return out end  -- most lists: a level with nothing below it
  for x in string.gmatch(s, '[^,]+') do out[#out + 1] = x end
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
  caps[j] = {meta = KEYS[b + 1], rows = KEYS[b + 2], lock = KEYS[b + 3], seen = KEYS[b + 4],
    -- core/sharing.Clock
    period_len = period, window = w, now = now, period = math.floor(now / period),
    epoch = math.floor(now * SPLIT / period), start = start, finish = start + w,
    capacity = tonumber(ARGV[a + 3]), declared = tonumber(ARGV[a + 4]), name = ARGV[a + 5],
    total = tonumber(ARGV[a + 6]), given_e = ARGV[a + 7], given = ARGV[a + 8],
    figures = figures, keep = math.max(2 * w + 1, STALE * period) * 1000}
  -- a client's row (and the seen index) outlives its last write by a period more than keep,
  -- and the slack: a row that can still count at a division (history up to STALE periods
  -- back) is never gone before it is stale (prune.lua)
  caps[j].row_keep = math.ceil(caps[j].keep + period * 1000 + SLACK_MS)
  a = a + CAP_ARGS
end
a = a + 1
for i = 1, tonumber(ARGV[a]) do
  local below_c, below_s = list(ARGV[a + 8]), list(ARGV[a + 9])
  for k = 1, #below_c do below_c[k] = tonumber(below_c[k]) end
  for k = 1, #below_s do below_s[k] = tonumber(below_s[k]) end
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
