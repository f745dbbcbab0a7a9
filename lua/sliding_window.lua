-- flowgate sliding window counter: two weighted counters, exact integer arithmetic in us.
--
-- KEYS[i]     the state, stored as "<window start us> <current> <previous>", one per request of the batch (a key may repeat)
-- ARGV[1]     limit
-- ARGV[2]     window, in us
-- ARGV[3]     now in us, for differential tests only; empty in production: Redis TIME is used
-- ARGV[3+i]   the cost of request i
--
-- estimate * window = previous * (window - elapsed) + current * window; admitted when
-- estimate + cost <= limit. The caller keeps limit * window below 2^52 (exact in doubles).
-- Requests are decided in order, each exactly as if it were alone. Returns, per request,
-- {allowed (0|1), limit, remaining, retry_after_us, reset_after_us}, flattened.
-- The key expires when both counters have decayed: every write sets the TTL to that, and a
-- rejection writes nothing but a TTL that ends before it. (The TTL a key has cannot be kept
-- on the word of its count: a gate of a shorter window, in a rolling deploy that made the
-- window longer, set it for its own window, and the count would vanish with the key while
-- this gate still counts it.)
-- The gate runs it with lua/prelude.lua in front (clock_us, ttl_ms, decide_batch).

local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local clock, explicit = clock_us(ARGV[3])

local function decide(key, cost)
local now = clock

local start, current, previous = 0, 0, 0
local state = redis.call('GET', key)
if state then
  local a, b, c = string.match(state, '^(%d+) (%d+) (%d+)$')
  -- Whole numbers below 2^53 (a start past it would set a TTL of ages, a count past it
  -- decide on inexact arithmetic), else the key is corrupt.
  start, current, previous = whole(tonumber(a)), whole(tonumber(b)), whole(tonumber(c))
end
local aligned = now - (now % window)
if aligned > start then
  if aligned - start == window then
    previous = current
  else
    previous = 0
  end
  current = 0
  start = aligned
end
-- A clock that stepped back is taken as no time passing, with the waits counted from now.
local behind = 0
if now < start then
  behind = start - now
  now = start
end
local elapsed = now - start

local function reset_after(cur, prev)
  local to_end = window - elapsed + behind
  if cur > 0 then
    return to_end + window
  elseif prev > 0 then
    return to_end
  end
  return 0
end

-- The earliest offset into a window (previous `prev`, current `cur`) where `cost` fits.
local function fits_from(prev, cur)
  local spare = limit - cur - cost
  if spare < 0 then
    return nil
  end
  if prev == 0 then
    return 0
  end
  local slack = math.floor(spare * window / prev)
  if slack > window then
    slack = window
  end
  return window - slack
end

local weighted = previous * (window - elapsed) + current * window
if weighted + cost * window <= limit * window then
  current = current + cost
  local after = previous * (window - elapsed) + current * window
  local reset = reset_after(current, previous)
  local value = string.format('%d %d %d', start, current, previous)
  redis.call('SET', key, value, 'PX', ttl_ms(reset, explicit))
  return {1, limit, math.floor((limit * window - after) / window), 0, reset}
end
local remaining = math.floor(math.max(0, limit * window - weighted) / window)
local retry
local e = fits_from(previous, current)
if e ~= nil and e < window then
  retry = e - elapsed + behind
else
  local e2 = fits_from(current, 0) or window
  retry = window - elapsed + e2 + behind
end
local reset = reset_after(current, previous)
-- A count another gate wrote may expire by its shorter window: kept while this one counts.
if state and reset > 0 and not explicit and redis.call('PTTL', key) * 1000 < reset then
  redis.call('PEXPIRE', key, ttl_ms(reset, explicit))
end
return {0, limit, remaining, retry, reset}
end

return decide_batch(decide, 3, 5)
