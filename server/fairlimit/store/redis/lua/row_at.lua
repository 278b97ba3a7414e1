-- row_at.lua: put before release.lua and settle.lua (script.SHARED), after the contract
-- (ROW_FIELD). Defines row_at.
--
-- Where a client's row at a cap is: its own hash (the rows key, ':' and the client: lua/
-- admit/rows.lua), else the fields <field>:<client> of the rows hash an earlier version
-- kept every row in. Returns the key, the suffix of its fields and the row's window and
-- period (nil when it has none).
local function row_at(rows, client)
  local key = rows .. ':' .. client
  local v = redis.call('HMGET', key, ROW_FIELD.window, ROW_FIELD.period)
  if v[1] then return key, '', v end
  return rows, ':' .. client, redis.call('HMGET', rows, ROW_FIELD.window .. ':' .. client,
    ROW_FIELD.period .. ':' .. client)
end
