-- lease.lua: admit one request on plain counters (no fair_share cap above any of them)
-- exactly as admit.lua does, and reserve for the calling replica a block of each counter's
-- remaining budget, which it then admits from locally (store/redis/lease.py states the rule).
--
-- The layout (lease.LEASE states it too; tests/test_redis_lease.py checks both agree):
-- KEYS  per counter: counter
-- ARGV  head: now replica
-- ARGV  per counter: limit window hits want
-- KEYS are the counter keys; ARGV is the head, then the number of counters and that many
-- rows.
--
-- counter  hash: s = window start, n = count in that window (reserved blocks included),
--          L:<replica> = the window start of that replica's last block, so that the
--          replicas holding blocks of this window can be counted
-- now ("" = Redis TIME); want = the block the replica asks for (0: none).
-- A block is min(want, what is left after this request / (2 x holders)); blocks are all or
-- nothing over the plan's counters (a replica admits locally only where every counter of
-- the plan has room), and none is given to a rejected request or below 1 hit.
-- Returns {1 | 0, now, counts, blocks}: 1 = charged; counts before the charge, as
-- admit.lua's; blocks[i] = hits reserved for the replica on counter i (0 = none).
-- Every key written gets a TTL. now crosses the boundary as a %.17g string.

local COUNTER_ARGS = 4
local SLACK_MS = 1000

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[1])
end
local holder = 'L:' .. ARGV[2]

local counters = {}
local a = 4
for i = 1, tonumber(ARGV[3]) do
  local w = tonumber(ARGV[a + 1])
  local start = math.floor(now / w) * w
  counters[i] = {key = KEYS[i], limit = tonumber(ARGV[a]), hits = tonumber(ARGV[a + 2]),
    want = tonumber(ARGV[a + 3]), ws = string.format('%.0f', start),
    ttl = (start + w - now) * 1000 + SLACK_MS}
  a = a + COUNTER_ARGS
end

local admitted = true
local counts, blocks = {}, {}
for i, c in ipairs(counters) do
  local held = redis.call('HMGET', c.key, 's', 'n')
  c.current = held[1] == c.ws
  counts[i] = c.current and tonumber(held[2]) or 0
  if counts[i] + math.max(c.hits, 1) > c.limit then admitted = false end
end

local grant = admitted
for i, c in ipairs(counters) do
  blocks[i] = 0
  if grant and c.want > 0 then
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
    local left = c.limit - counts[i] - c.hits
    blocks[i] = math.min(c.want, math.floor(left / (2 * holders)))
  end
  if blocks[i] < 1 then grant = false end
end
if not grant then
  for i = 1, #counters do blocks[i] = 0 end
end

if admitted then
  for i, c in ipairs(counters) do
    local add = c.hits + blocks[i]
    if c.current then
      if add ~= 0 then redis.call('HINCRBY', c.key, 'n', add) end
    else
      redis.call('HSET', c.key, 's', c.ws, 'n', add)
      redis.call('PEXPIRE', c.key, math.ceil(c.ttl))
    end
    if blocks[i] > 0 then redis.call('HSET', c.key, holder, c.ws) end
  end
end
return {admitted and 1 or 0, string.format('%.17g', now), counts, blocks}
