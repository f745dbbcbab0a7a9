-- flowgate fixed window: at most `limit` per aligned window, in microseconds.
--
-- KEYS[i]     the window's state (a hash: `w` window index, `n` count), one per request of the
--             batch (a key may repeat). Only declared keys are touched, so the script runs on
--             Redis Cluster with any key.
-- ARGV[1]     limit
-- ARGV[2]     window, in us
-- ARGV[3]     now in us, for differential tests only; empty in production: Redis TIME is used
-- ARGV[3+i]   the cost of request i
--
-- Windows are aligned to the Redis clock's epoch: window k is [k*window, (k+1)*window).
-- Requests are decided in order, each exactly as if it were alone. Returns, per request,
-- {allowed (0|1), limit, remaining, retry_after_us, reset_after_us}, flattened.
-- A rejected call writes nothing. The key expires when its window ends: the write that
-- starts a window sets the TTL; later writes in the window keep it.
-- The gate runs it with lua/prelude.lua in front (clock_us, ttl_ms, decide_batch).

local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local clock, explicit = clock_us(ARGV[3])

local function decide(key, cost)
local now = clock

local index = math.floor(now / window)
local reset = (index + 1) * window - now
-- The index is compared as the text it is stored as, in full ('%d': tostring keeps only 14
-- digits, and a window of a few microseconds has 15 or more at today's clock, so windows
-- shared a text and were counted as one).
local w = string.format('%d', index)
local state = redis.call('HMGET', key, 'w', 'n')
-- Both whole numbers when there: a count or an index out of range would be decided on
-- garbage (a negative count admitting past the limit, an index ahead of every window
-- keeping a key without a TTL counting for ever).
local index_was = state[1] and whole(tonumber(state[1]))
local count_was = state[2] and whole(tonumber(state[2])) or 0
local same = state[1] == w
-- A clock that stepped back (a failover to a replica whose clock is behind) stays in the
-- window already counted, as the model does, instead of starting an earlier one afresh; its
-- end is counted from now.
local counted = not same and index_was
if counted and counted > index then
  same = true
  reset = (counted + 1) * window - now
  -- The count lasts no longer than its key, which expires when that window ends: as said
  -- above after a step back, but a window counted by a gate of another period (a rolling
  -- deploy that made the window longer, over the same prefix) has an index of another
  -- scale, and the end it gives lies ages away. What the key has left bounds it: PTTL
  -- counts whole ms, and the key lasts to the end of its last one (it expires once the
  -- clock's ms is past it), so never 0 (a client told to retry after nothing asks again
  -- at once, and is rejected again until that ms ends).
  if not explicit then
    local left = redis.call('PTTL', key)
    local gone = (left + 1) * 1000 - now % 1000
    if left >= 0 and gone < reset then
      reset = gone
    end
  end
end
local used = same and count_was or 0
if used + cost <= limit then
  if same then
    redis.call('HINCRBY', key, 'n', cost)
  else
    redis.call('HSET', key, 'w', w, 'n', cost)
    redis.call('PEXPIRE', key, ttl_ms(reset, explicit))
  end
  return {1, limit, limit - used - cost, 0, reset}
end
return {0, limit, limit - used, reset, reset}
end

return decide_batch(decide, 3, 5)
