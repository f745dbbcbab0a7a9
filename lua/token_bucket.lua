-- flowgate token bucket (GCRA), exact integer arithmetic in microseconds.
--
-- KEYS[i]     the buckets, one per request of the batch (a key may repeat)
-- ARGV[1]     rate count          (units per period)
-- ARGV[2]     rate period, in us
-- ARGV[3]     burst
-- ARGV[4]     now in us, for differential tests only; empty in production: Redis TIME is used
-- ARGV[4+i]   the cost of request i
--
-- The state is the theoretical arrival time TAT, stored as "<us> <frac>": TAT = us + frac/count
-- microseconds. Every quantity the script multiplies is relative to now and bounded by
-- burst * period, which the caller keeps below 2^52, so all arithmetic is exact in doubles.
-- Time is measured in units of 1/count us; one token is `period` units.
--
-- Requests are decided in order, each exactly as if it were alone. Returns, per request,
-- {allowed (0|1), limit, remaining, retry_after_us, reset_after_us}, flattened.
-- A rejected request writes nothing. A key expires when its bucket is full again.

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

-- With an explicit (logical) time the keys live for a minute of real time instead: logical
-- time in a differential test runs far ahead of the wall clock that expires keys.
local explicit = ARGV[4] ~= nil and ARGV[4] ~= ''
local function ttl_ms(ms)
  if explicit then
    return 60000
  end
  return ms
end

local tau = burst * period

local function ceil_us(units)
  return math.floor((units + count - 1) / count)
end

local function decide(key, cost)
local used = 0
local state = redis.call('GET', key)
if state then
  local sep = string.find(state, ' ', 1, true)
  local tat_us = tonumber(string.sub(state, 1, sep - 1))
  local tat_frac = tonumber(string.sub(state, sep + 1))
  if tat_us >= now then
    used = (tat_us - now) * count + tat_frac
  end
end

local used_after = used + cost * period
if used_after <= tau then
  local ahead = math.floor(used_after / count)
  local frac = used_after - ahead * count
  local ttl = math.max(1, math.floor((ceil_us(used_after) + 999) / 1000))
  redis.call('SET', key, string.format('%d %d', now + ahead, frac), 'PX', ttl_ms(ttl))
  return {1, burst, math.floor((tau - used_after) / period), 0, ceil_us(used_after)}
end
if used > tau then
  used = tau
end
return {0, burst, math.floor((tau - used) / period), ceil_us(used_after - tau), ceil_us(used)}
end

local out = {}
for i, key in ipairs(KEYS) do
  local r = decide(key, tonumber(ARGV[4 + i]))
  for j = 1, 5 do
    out[#out + 1] = r[j]
  end
end
return out
