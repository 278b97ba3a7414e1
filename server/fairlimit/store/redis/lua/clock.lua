-- clock.lua: not a script of its own; script.source() puts it before every script, so each
-- reads the time one way: the caller's clock when ARGV[1] gives one (tests, simulations),
-- else Redis TIME, the one clock every replica shares.
local function clock(given)
  if given == '' then
    local t = redis.call('TIME')
    return tonumber(t[1]) + tonumber(t[2]) / 1000000
  end
  return tonumber(given)
end

