-- flowgate script prelude: the gate puts this file in front of every script in lua/.

-- The time of the call in microseconds, and whether it was given: `arg` (an ARGV entry)
-- when not empty, for differential tests that run on logical time; else the Redis clock.
local function clock_us(arg)
  if arg ~= nil and arg ~= '' then
    return tonumber(arg), true
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2]), false
end

-- The TTL in ms of a key whose state lasts `us` more microseconds: rounded up, at least
-- 1 ms. With an explicit (logical) time the keys live for a minute of real time instead:
-- logical time in a differential test runs far ahead of the wall clock that expires keys.
local function ttl_ms(us, explicit)
  if explicit then
    return 60000
  end
  return math.max(1, math.floor((us + 999) / 1000))
end

-- The first value of a request's reply when its key could not be decided (a Redis error on
-- that key, e.g. WRONGTYPE: the key holds another gate's state): only that request fails,
-- not the batch. -2^53: exact in a double, and below every value a script returns.
local KEY_ERROR = -9007199254740992

-- Decide every request of a batch, in order: request i is decide(KEYS[i], ARGV[costs + i]),
-- which returns its 5 values; they come back flattened. A request whose key fails gets
-- {KEY_ERROR, 0, 0, 0, 0} (its reads fail before any write).
local function decide_batch(decide, costs)
  local out = {}
  for i, key in ipairs(KEYS) do
    local ok, r = pcall(decide, key, tonumber(ARGV[costs + i]))
    if not ok then
      r = {KEY_ERROR, 0, 0, 0, 0}
    end
    for j = 1, 5 do
      out[#out + 1] = r[j]
    end
  end
  return out
end
