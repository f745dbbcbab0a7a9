-- flowgate token bucket (GCRA), exact integer arithmetic in microseconds.
-- The gate runs it with lua/prelude.lua and lua/bucket_state.lua in front (clock_us,
-- bucket_read, bucket_write).
--
-- KEYS[i]     the buckets, one per request of the batch (a key may repeat)
-- ARGV[1]     rate count          (units per period)
-- ARGV[2]     rate period, in us
-- ARGV[3]     burst
-- ARGV[4]     now in us, for differential tests only; empty in production: Redis TIME is used
-- ARGV[4+i]   the cost of request i
--
-- Time is measured in units of 1/count us; one token is `period` units and the bucket holds
-- tau = burst * period. Every quantity the script multiplies is relative to now and bounded by
-- burst * period, which the caller keeps below 2^52, so all arithmetic is exact in doubles.
--
-- Requests are decided in order, each exactly as if it were alone. Returns one integer per
-- request: the bucket's fill after the request (used_after >= 0) if it is admitted, or
-- -1 - used (its fill before, < 0) if it is rejected, or KEY_WRONGTYPE / KEY_CORRUPT if its
-- key could not be read; a rejected request writes nothing. The
-- caller derives remaining, retry_after and reset_after from it (flowgate::gate::lua::
-- token_bucket_reply): one number instead of five is cheaper for Redis to build and send.

local count = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local now, explicit = clock_us(ARGV[4])
local tau = burst * period

local function decide(key, cost)
  local used, exp_us = bucket_read(key, now, count)
  local used_after = used + cost * period
  if used_after <= tau then
    bucket_write(key, now, count, used_after, exp_us, explicit)
    return used_after
  end
  return -1 - used
end

-- A request whose key fails gets its marker (lua/prelude.lua); the others are decided as
-- usual; a failure of Redis fails the call.
return decide_batch(decide, 4, 1)
