-- flowgate multi-limit: all-or-nothing across several token buckets (GCRA), in one script.
--
-- KEYS[i]       the buckets (IP, user, tenant ...), each once; on Redis Cluster they must
--               share a slot
-- ARGV[1]       now in us, for differential tests only; empty in production: Redis TIME is used
-- ARGV[4i-2..]  for bucket i: rate count, rate period in us, burst, cost
--               (ARGV[4i-2], [4i-1], [4i], [4i+1])
--
-- The request is admitted only if every bucket has room for its cost; then every bucket is
-- charged. If any bucket lacks room nothing is charged anywhere. Same state format and
-- arithmetic as token_bucket.lua (lua/prelude.lua and lua/bucket_state.lua are put in
-- front). Every bucket is read before any is written. Returns {allowed, limit, remaining,
-- retry_after_us, reset_after_us} per bucket, flattened; `allowed` is the same for all. If a
-- bucket's value cannot be read, nothing is written and that bucket's first value is its
-- marker (KEY_WRONGTYPE / KEY_CORRUPT), the others' 0. A failure of Redis itself (it refuses
-- writes) fails the call.

local now, explicit = clock_us(ARGV[1])

local buckets = {}
local all = true
local failed = false
for i, key in ipairs(KEYS) do
  local count = tonumber(ARGV[4 * i - 2])
  local period = tonumber(ARGV[4 * i - 1])
  local burst = tonumber(ARGV[4 * i])
  local cost = tonumber(ARGV[4 * i + 1])
  local tau = burst * period
  local ok, used, exp_us = pcall(bucket_read, key, now, count)
  local marker = 0
  if not ok then
    local msg
    marker, msg = key_failure(used)
    if not marker then
      return redis.error_reply(msg)
    end
    failed = true
    used, exp_us = 0, 0
  end
  local used_after = used + cost * period
  if used_after > tau then
    all = false
  end
  buckets[i] = {key, count, period, burst, tau, used, used_after, exp_us, marker}
end

local out = {}
if failed then
  for _, b in ipairs(buckets) do
    for _, v in ipairs({b[9], 0, 0, 0, 0}) do
      out[#out + 1] = v
    end
  end
  return out
end
for _, b in ipairs(buckets) do
  local key, count, period, burst, tau, used, used_after, exp_us = unpack(b)
  if all then
    bucket_write(key, now, count, used_after, exp_us, explicit)
    for _, v in ipairs({1, burst, math.floor((tau - used_after) / period), 0, ceil_us(used_after, count)}) do
      out[#out + 1] = v
    end
  else
    local held = math.min(used, tau)
    local retry = 0
    if used_after > tau then
      retry = ceil_us(used_after - tau, count)
    end
    -- reset: all of `used`, which exceeds tau only if the clock stepped back or a gate of a
    -- larger burst wrote it (a rolling deploy that lowered the burst).
    for _, v in ipairs({0, burst, math.floor((tau - held) / period), retry, ceil_us(used, count)}) do
      out[#out + 1] = v
    end
  end
end
return out
