-- flowgate token lease: take between `min` and `max` tokens of one bucket (GCRA) at once.
--
-- KEYS[1]  the bucket (same state format as token_bucket.lua: lua/prelude.lua and
--          lua/bucket_state.lua are put in front)
-- ARGV[1]  rate count
-- ARGV[2]  rate period, in us
-- ARGV[3]  burst
-- ARGV[4]  now in us, for differential tests only; empty in production: Redis TIME is used
-- ARGV[5]  min: the cost of the request that needs the lease
-- ARGV[6]  max: the lease size wanted; 0 (with min 0) takes nothing and writes nothing
--
-- If at least `min` tokens are there, takes min(max, available) of them, debited in Redis
-- before any is used, so the instance that holds them can never over-admit. Otherwise takes
-- nothing. Returns {granted, limit, remaining, retry_after_us (for `min`), reset_after_us},
-- or {KEY_WRONGTYPE | KEY_CORRUPT, 0, 0, 0, 0} when the key's value cannot be read
-- (lua/prelude.lua); a failure of Redis itself (it refuses writes) fails the call.

local count = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local now, explicit = clock_us(ARGV[4])
local want_min = tonumber(ARGV[5])
local want_max = tonumber(ARGV[6])

local tau = burst * period
local ok, used, exp_us = pcall(bucket_read, KEYS[1], now, count)
if not ok then
  local marker, msg = key_failure(used)
  if not marker then
    return redis.error_reply(msg)
  end
  return {marker, 0, 0, 0, 0}
end

local available = math.floor((tau - math.min(used, tau)) / period)
if want_max == 0 then
  -- A touch: the gate asks whether Redis still holds its state (it would meet NOSCRIPT
  -- after a restart) before it spends tokens it leased. Takes and writes nothing.
  return {0, burst, available, 0, ceil_us(used, count)}
end
if available < want_min then
  local used_after = used + want_min * period
  -- reset: all of `used`, which exceeds tau only if the clock stepped back or a gate of a
  -- larger burst wrote it (a rolling deploy that lowered the burst).
  return {0, burst, available, ceil_us(used_after - tau, count), ceil_us(used, count)}
end
local granted = math.min(want_max, available)
local used_after = used + granted * period
bucket_write(KEYS[1], now, count, used_after, exp_us, explicit)
return {granted, burst, math.floor((tau - used_after) / period), 0, ceil_us(used_after, count)}
