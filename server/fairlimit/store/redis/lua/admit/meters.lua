-- admit/meters.lua: part 5 of the admit script (lua/admit/args.lua states its layout and
-- the order of the parts): the counters of kind "s" (a sliding window) and "g" (GCRA), as
-- core/smooth.py states them; fixed and calendar windows are counted in decide.lua and
-- charged in charge.lua (fields s and n), their window picked in args.lua (calendar).
-- KEYS: a counter's hash: p<k> = "<index>:<hits>" (sliding), t = its tat (GCRA).
-- ARGV: none.
-- Reads: SLIDING_PARTS SMOOTH_EPSILON (contract), fmt whole now (args.lua).
-- Defines: part_of meter_count meter_charge meter_full.

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
