-- flowgate multi-limit: all-or-nothing across several token buckets (GCRA), in one script.
--
-- KEYS[i]       the buckets (IP, user, tenant ...); on Redis Cluster they must share a slot
-- ARGV[1]       now in us, for differential tests only; empty in production: Redis TIME is used
-- ARGV[2]       cost
-- ARGV[3i..]    for bucket i: rate count, rate period in us, burst (ARGV[3i], [3i+1], [3i+2])
--
-- The request is admitted only if every bucket has room; then every bucket is charged. If
-- any bucket lacks room nothing is charged anywhere. Same state format and arithmetic as
-- token_bucket.lua (lua/prelude.lua and lua/bucket_state.lua are put in front). Returns
-- {allowed, limit, remaining, retry_after_us, reset_after_us} per bucket, flattened;
-- `allowed` is the same for all.

local now, explicit = clock_us(ARGV[1])
local cost = tonumber(ARGV[2])

local buckets = {}
local all = true
for i, key in ipairs(KEYS) do
  local count = tonumber(ARGV[3 * i])
  local period = tonumber(ARGV[3 * i + 1])
  local burst = tonumber(ARGV[3 * i + 2])
  local tau = burst * period
  local used, exp_us = bucket_read(key, now, count)
  local used_after = used + cost * period
  if used_after > tau then
    all = false
  end
  buckets[i] = {key, count, period, burst, tau, used, used_after, exp_us}
end

local out = {}
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
    for _, v in ipairs({0, burst, math.floor((tau - held) / period), retry, ceil_us(held, count)}) do
      out[#out + 1] = v
    end
  end
end
return out
