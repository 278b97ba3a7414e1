-- admit/charge.lua: part 8, the last, of the admit script (lua/admit/args.lua states its
-- layout and the order of the parts): the charges (all levels when admitted, else only
-- those that force), the rows, divisions and light demand written back, the reservation
-- records kept (admitted), and the reply.
-- KEYS: counters (n, s, r, t, p<k>, L:<consumer>), each cap's rows and meta, the records.
-- ARGV: none.
-- Reads: DIVISION_FIELD LIGHT_FIELD (contract), counters caps shares n records holder
-- SLACK_MS MAX_TTL_MS now fmt (args.lua), admitted counts shared bounds rolled wanted was
-- (decide.lua), block (lease.lua), meter_charge meter_full (meters.lua), enter
-- (division.lua), save_row (rows.lua).
-- Defines: full; returns {1 | 0, now, block, n, k, r, w, counts, full, was, admitted,
-- bounds, rolled, wanted}, flat (args.lua states it).

-- Refused, only the levels of charge_when_over_limit rules are charged; admitted, all.
local full = {}
for i, c in ipairs(counters) do
  local add = c.hits + block
  if c.meter then
    if add ~= 0 and (admitted or c.force) then meter_charge(c, add) end
    local at = meter_full(c)
    full[i] = fmt(at)
    if at > now then
      local ttl = math.ceil((at - now) * 1000 + SLACK_MS)
      redis.call('PEXPIRE', c.key, math.min(ttl, MAX_TTL_MS))
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
-- One flat list: Redis converts each table of a reply on its own, at a cost of its own.
local k = #shares
local out = {admitted and 1 or 0, fmt(now), block, n, k, #rolled, #wanted}
for i = 1, n do out[7 + i], out[7 + n + i], out[7 + 2 * n + i] = counts[i], full[i], was[i] end
local at = 7 + 3 * n
for i = 1, k do out[at + i], out[at + k + i] = shared[i], bounds[i] end
at = at + 2 * k
for i = 1, #rolled do out[at + i] = rolled[i] end
at = at + #rolled
for i = 1, #wanted do out[at + i] = wanted[i] end
return out
