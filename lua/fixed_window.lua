-- flowgate fixed window: at most `limit` per aligned window, in microseconds.
--
-- KEYS[1]  the counter prefix (the window index is appended)
-- ARGV[1]  limit
-- ARGV[2]  window, in us
-- ARGV[3]  cost
-- ARGV[4]  now in us, for differential tests only; empty in production: Redis TIME is used
--
-- Windows are aligned to the Redis clock's epoch: window k is [k*window, (k+1)*window).
-- Returns {allowed (0|1), limit, remaining, retry_after_us, reset_after_us}.
-- A rejected call writes nothing. Each window's key expires when the window ends.

local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local now
if ARGV[4] ~= nil and ARGV[4] ~= '' then
  now = tonumber(ARGV[4])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local index = math.floor(now / window)
local key = KEYS[1] .. ':' .. index
local reset = (index + 1) * window - now
local used = tonumber(redis.call('GET', key) or '0')
if used + cost <= limit then
  redis.call('INCRBY', key, cost)
  redis.call('PEXPIRE', key, math.max(1, math.floor((reset + 999) / 1000)))
  return {1, limit, limit - used - cost, 0, reset}
end
return {0, limit, limit - used, reset, reset}
