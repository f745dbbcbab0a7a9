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
-- A rejected call writes no entry and removes none (not even the expired ones: a clock
-- that steps back after it must still see them, as the model does). The key expires when
-- its newest entry does: a write sets the TTL to that, and a rejection extends a TTL that
-- ends before it (a log written by a gate of a shorter window, in a rolling deploy that
-- made the window longer, would otherwise vanish while this gate still counts it full).
-- The gate runs it with lua/prelude.lua in front (clock_us, ttl_ms, decide_batch).

local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local clock, explicit = clock_us(ARGV[3])

-- The live log of each key read in this call: read once, then kept as the requests admitted
-- here add to it, so a batch of n requests on one key reads its log once, not n times. The
-- clock is read once per call, so a key's `now` (and with it which entries are live) is the
-- same for every request on it. A failed read (another type, a member that is not ours) is
-- not kept: each request on the key fails alike.
local logs = {}

local function read_log(key)
  -- Time never goes backwards for a log: an older `now` counts as the newest entry's time.
  local now = clock
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  -- Times and costs are whole numbers below 2^53, else the key is corrupt (a time past it
  -- would put `now` out of exact range, a cost past it make the arithmetic inexact).
  if newest[2] and whole(tonumber(newest[2])) > now then
    now = tonumber(newest[2])
  end
  -- The live entries, oldest first: admitted after now - window. Each as {time, cost}.
  local raw = redis.call('ZRANGEBYSCORE', key, string.format('(%d', now - window), '+inf',
    'WITHSCORES')
  local entries = {}
  local total = 0
  -- The largest seq of the entries at `now` (the clock stepped back to the newest entry's
  -- time, after older entries expired): a new entry takes one past it, so its member is new.
  local top_seq = -1
  for i = 1, #raw, 2 do
    local member = raw[i]
    local t = whole(tonumber(raw[i + 1]))
    local c = whole(tonumber(string.match(member, ':(%d+)$')))
    entries[#entries + 1] = {t, c}
    total = total + c
    if t == now then
      local held = tonumber(string.match(member, '^%d+:(%d+):'))
      if held and held > top_seq then
        top_seq = held
      end
    end
  end
  return {now = now, entries = entries, total = total, top_seq = top_seq}
end

local function decide(key, cost)
local log = logs[key]
if log == nil then
  log = read_log(key)
  logs[key] = log
end
local now = log.now
-- The waits are counted from the time given.
local given = clock
local total = log.total
local costs = log.entries

if total + cost <= limit then
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  local seq = redis.call('ZCARD', key)
  if log.top_seq >= seq then
    seq = log.top_seq + 1
  end
  redis.call('ZADD', key, now, string.format('%d:%d:%d', now, seq, cost))
  -- The entry counts a window from `now`, which is ahead of the clock that expires keys
  -- (`given`) when the clock stepped back behind the newest entry.
  redis.call('PEXPIRE', key, ttl_ms(now + window - given, explicit))
  costs[#costs + 1] = {now, cost}
  log.total = total + cost
  log.top_seq = seq
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
  if not explicit and redis.call('PTTL', key) * 1000 < reset then
    redis.call('PEXPIRE', key, ttl_ms(reset, explicit))
  end
end
return {0, limit, limit - total, retry, reset}
end

return decide_batch(decide, 3, 5)
