-- flowgate sliding log: at most `limit` in any interval of `window` us, exactly.
--
-- KEYS[i]     the log (a sorted set: score = admission time in us, member = "<us>:<seq>:<cost>"), one per request of the batch (a key may repeat)
-- ARGV[1]     limit
-- ARGV[2]     window, in us
-- ARGV[3]     now in us, for differential tests only; empty in production: Redis TIME is used
-- ARGV[3+i]   the cost of request i
--
-- An entry admitted at t counts while now < t + window. Memory: at most `limit` members.
-- Requests are decided in order, each exactly as if it were alone. Returns, per request,
-- {allowed (0|1), limit, remaining, retry_after_us, reset_after_us}, flattened.
-- A rejected call writes nothing (not even the removal of expired entries: a clock that
-- steps back after it must still see them, as the model does). The key expires when its
-- newest entry does.
-- The gate runs it with lua/prelude.lua in front (clock_us, ttl_ms, decide_batch).

local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local clock, explicit = clock_us(ARGV[3])

local function decide(key, cost)
local now = clock

-- Time never goes backwards for a log: an older `now` counts as the newest entry's time.
-- The waits are counted from the time given (`given`).
local given = now
local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if newest[2] and tonumber(newest[2]) > now then
  now = tonumber(newest[2])
end
-- The live entries: admitted after now - window.
local entries = redis.call('ZRANGEBYSCORE', key, string.format('(%d', now - window), '+inf',
  'WITHSCORES')
local total = 0
local costs = {}
for i = 1, #entries, 2 do
  local member = entries[i]
  local c = tonumber(string.match(member, ':(%d+)$'))
  costs[#costs + 1] = {tonumber(entries[i + 1]), c}
  total = total + c
end

if total + cost <= limit then
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  local seq = redis.call('ZCARD', key)
  -- Entries already at `now` (the clock stepped back to the newest entry's time, after older
  -- entries expired) may hold this seq: take one past theirs, so the member is a new one.
  for i = 1, #entries, 2 do
    if tonumber(entries[i + 1]) == now then
      local held = tonumber(string.match(entries[i], '^%d+:(%d+):'))
      if held and held >= seq then
        seq = held + 1
      end
    end
  end
  redis.call('ZADD', key, now, string.format('%d:%d:%d', now, seq, cost))
  redis.call('PEXPIRE', key, ttl_ms(window, explicit))
  return {1, limit, limit - total - cost, 0, now + window - given}
end
local need = total + cost - limit
local retry = 0
for _, e in ipairs(costs) do
  retry = e[1] + window - given
  if e[2] >= need then
    break
  end
  need = need - e[2]
end
local reset = 0
if #costs > 0 then
  reset = costs[#costs][1] + window - given
end
return {0, limit, limit - total, retry, reset}
end

return decide_batch(decide, 3, 5)
