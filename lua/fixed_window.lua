-- flowgate fixed window: at most `limit` per aligned window, in microseconds.
--
-- KEYS[i]     the counter prefix (the window index is appended), one per request of the batch (a key may repeat)
-- ARGV[1]     limit
-- ARGV[2]     window, in us
-- ARGV[3]     now in us, for differential tests only; empty in production: Redis TIME is used
-- ARGV[3+i]   the cost of request i
--
-- Windows are aligned to the Redis clock's epoch: window k is [k*window, (k+1)*window).
-- Requests are decided in order, each exactly as if it were alone. Returns, per request,
-- {allowed (0|1), limit, remaining, retry_after_us, reset_after_us}, flattened.
-- A rejected call writes nothing. Each window's key expires when the window ends: the write
-- that creates it sets the TTL.
-- The gate runs it with lua/prelude.lua in front (clock_us, ttl_ms, decide_batch).

local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local clock, explicit = clock_us(ARGV[3])

local function decide(key, cost)
local now = clock

local index = math.floor(now / window)
local key = key .. ':' .. index
local reset = (index + 1) * window - now
local used = tonumber(redis.call('GET', key) or '0')
if used + cost <= limit then
  -- The write that creates the window's key sets its TTL (to the window's end); the others
  -- leave it, which saves Redis a PEXPIRE per admitted request.
  if redis.call('INCRBY', key, cost) == cost then
    redis.call('PEXPIRE', key, ttl_ms(reset, explicit))
  end
  return {1, limit, limit - used - cost, 0, reset}
end
return {0, limit, limit - used, reset, reset}
end

return decide_batch(decide, 3)
