-- flowgate token lease: take between `min` and `max` tokens of one bucket (GCRA) at once.
--
-- KEYS[1]  the bucket (same state format as token_bucket.lua)
-- ARGV[1]  rate count
-- ARGV[2]  rate period, in us
-- ARGV[3]  burst
-- ARGV[4]  now in us, for differential tests only; empty in production: Redis TIME is used
-- ARGV[5]  min: the cost of the request that needs the lease
-- ARGV[6]  max: the lease size wanted
--
-- If at least `min` tokens are there, takes min(max, available) of them, debited in Redis
-- before any is used, so the instance that holds them can never over-admit. Otherwise takes
-- nothing. Returns {granted, limit, remaining, retry_after_us (for `min`), reset_after_us}.

local count = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local now
if ARGV[4] ~= nil and ARGV[4] ~= '' then
  now = tonumber(ARGV[4])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local explicit = ARGV[4] ~= nil and ARGV[4] ~= ''
local want_min = tonumber(ARGV[5])
local want_max = tonumber(ARGV[6])

local tau = burst * period
local used = 0
local state = redis.call('GET', KEYS[1])
if state then
  local sep = string.find(state, ' ', 1, true)
  local tat_us = tonumber(string.sub(state, 1, sep - 1))
  local tat_frac = tonumber(string.sub(state, sep + 1))
  if tat_us >= now then
    used = (tat_us - now) * count + tat_frac
  end
end
local function ceil_us(units)
  return math.floor((units + count - 1) / count)
end

local available = math.floor((tau - math.min(used, tau)) / period)
if available < want_min then
  local used_after = used + want_min * period
  return {0, burst, available, ceil_us(used_after - tau), ceil_us(math.min(used, tau))}
end
local granted = math.min(want_max, available)
local used_after = used + granted * period
local ahead = math.floor(used_after / count)
local frac = used_after - ahead * count
local ttl = math.max(1, math.floor((ceil_us(used_after) + 999) / 1000))
if explicit then
  ttl = 60000
end
redis.call('SET', KEYS[1], string.format('%d %d', now + ahead, frac), 'PX', ttl)
return {granted, burst, math.floor((tau - used_after) / period), 0, ceil_us(used_after)}
