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

-- The first value of a request's reply when its key could not be decided: only that request
-- fails, not the batch, and the gate stays healthy. Both are below every value a script
-- returns, and exact in a double.
--   KEY_WRONGTYPE  the key holds a value of another type (another gate's state?)
--   KEY_CORRUPT    the key holds a value of the right type that is not a state this script
--                  can read (short, not a number, NaN, infinite, out of range)
local KEY_WRONGTYPE = -9007199254740992
local KEY_CORRUPT = -9007199254740991

-- Raised (as this very table) by a script that finds a key's value unreadable.
local CORRUPT = {}
local function corrupt()
  error(CORRUPT)
end

-- `x`, a number read from a key, if it is a whole number a double holds exactly (0 <= x <
-- 2^53, as every number the scripts write); else the key is corrupt (nil, NaN, infinite,
-- negative, a fraction, too large).
local function whole(x)
  if not (type(x) == 'number' and x >= 0 and x < 9007199254740992 and math.floor(x) == x) then
    corrupt()
  end
  return x
end

-- Error codes with which the server refuses to run a command at all (memory, replication,
-- loading, a busy script, cluster state): a failure of Redis, never of one key.
local REFUSED = {'OOM', 'READONLY', 'NOREPLICAS', 'BUSY', 'LOADING', 'MASTERDOWN', 'TRYAGAIN',
  'CLUSTERDOWN', 'MISCONF'}

-- What an error `e` raised while deciding one request means: that key's own failure
-- (returns its marker), or a failure of Redis (returns nil and the error text to fail the
-- whole call with, its code first: Redis 6 puts the script's position in front of it), so
-- the gate's failure policy applies.
--   - our CORRUPT marker, or a Lua error on the key's data            -> KEY_CORRUPT
--   - WRONGTYPE                                                       -> KEY_WRONGTYPE
--   - an error reply of Redis (a table) or a text with one of the
--     REFUSED codes                                                   -> the whole call fails
local function key_failure(e)
  if e == CORRUPT then
    return KEY_CORRUPT
  end
  local msg = type(e) == 'table' and tostring(e.err) or tostring(e)
  if string.find(msg, 'WRONGTYPE', 1, true) then
    return KEY_WRONGTYPE
  end
  for _, code in ipairs(REFUSED) do
    local at = string.find(msg, code, 1, true)
    if at then
      return nil, string.sub(msg, at)
    end
  end
  if type(e) == 'table' then
    return nil, msg
  end
  return KEY_CORRUPT
end

-- Decide every request of a batch, in order: request i is decide(KEYS[i], ARGV[costs + i]).
-- `width` 5: decide returns 5 values, which come back flattened, and a request whose key
-- fails gets {marker, 0, 0, 0, 0}; `width` 1: decide returns one integer, and a failing key
-- gets its marker. A failure of Redis itself fails the whole call (see key_failure).
local function decide_batch(decide, costs, width)
  local out = {}
  for i, key in ipairs(KEYS) do
    local ok, r = pcall(decide, key, tonumber(ARGV[costs + i]))
    if not ok then
      local marker, msg = key_failure(r)
      if not marker then
        return redis.error_reply(msg)
      end
      r = width == 1 and marker or {marker, 0, 0, 0, 0}
    end
    if width == 1 then
      out[i] = r
    else
      for j = 1, 5 do
        out[#out + 1] = r[j]
      end
    end
  end
  return out
end
