-- admit/lease.lua: part 7 of the admit script (lua/admit/args.lua states its layout and
-- the order of the parts): the lease block an admitted request reserves when want > 0
-- (core/lease.size states the rule).
-- KEYS: counters (HGETALL: the L:<consumer> fields of the block holders in this window).
-- ARGV: none (args.lua read consumer and want into holder and want_block).
-- Reads: holder want_block counters shares (args.lua), admitted counts shared and the
-- shares' kind, bound and wanted (decide.lua), OPEN EPSILON.
-- Defines: block (0 = none).

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
