-- flowgate token bucket state, shared by token_bucket.lua, token_bucket_all.lua and
-- token_bucket_lease.lua: the gate puts this file in front of each of them (after
-- lua/prelude.lua).
--
-- A bucket is one string key of 25 bytes: a zero byte (the text form below never starts
-- with one), then three little-endian doubles (every value is an integer below 2^53, so
-- exact):
--   tat_us   the theoretical arrival time (TAT), whole microseconds of the Redis clock
--   frac     the rest of the TAT, in units of 1/count us (0 <= frac < count), `count` the
--            rate count of the gate that wrote it (another may read it: see bucket_read)
--   exp_us   until this time the key is known not to expire (0: not known)
-- The text form "<tat_us> <frac>" of earlier development builds is still read. KEEPTTL needs
-- Redis 6.0 or later.
--
-- TTL: a write sets the key's TTL only when the bucket would outlive it, and then to the time
-- the bucket is full again plus SLACK_MS; other writes keep the TTL (SET KEEPTTL), which costs
-- Redis about half as much as SET PX. A key therefore expires at most SLACK_MS + 1 ms after
-- its bucket is full again, and never before.

local SLACK_MS = 1000

-- The largest fill a bucket can hold and still be computed exactly (2^52 units: see
-- token_bucket.lua).
local EXACT = 4503599627370496
-- Times (us of the Redis clock) past this one (2^53, in the year 2255) are not exact in a
-- double: no write puts a TAT or an expiry there.
local LAST_US = 9007199254740992

-- The bucket's fill at `now` (units of 1/count us: one token is `period` units) and exp_us.
-- A value that is not a bucket state (the wrong length, not numbers, NaN, infinite, negative,
-- a fraction, a TAT past LAST_US, an expiry further past the TAT than any write puts it)
-- raises CORRUPT (lua/prelude.lua): that request fails alone, with a key error, instead of
-- being decided on garbage. NaN fails every comparison, so each check is written to fail on
-- it.
--
-- A TAT further ahead of `now` than exact arithmetic reaches (more than EXACT units) is
-- one the Redis clock stepped back behind (a failover to a replica whose clock is behind, a
-- clock step): the fill is then EXACT, above any bucket (tau < EXACT), so the request is
-- rejected, as the model rejects it, with waits counted as if the clock had stepped back
-- only that far (a lower bound: never later than the bucket has room). A rejection writes
-- nothing.
local function bucket_read(key, now, count)
  local state = redis.call('GET', key)
  if not state then
    return 0, 0
  end
  local tat_us, frac, exp_us
  if string.byte(state, 1) == 0 then
    if #state ~= 25 then
      corrupt()
    end
    local _
    _, tat_us, frac, exp_us = struct.unpack('<Bddd', state)
  else
    local sep = string.find(state, ' ', 1, true)
    if not sep then
      corrupt()
    end
    tat_us = tonumber(string.sub(state, 1, sep - 1))
    frac = tonumber(string.sub(state, sep + 1))
    exp_us = 0
  end
  -- Every value a write puts there is a whole number (whole(): not nil, NaN, infinite,
  -- negative or a fraction); a write sets the expiry at most SLACK_MS after the TAT (see
  -- bucket_write), and later writes only move the TAT on.
  whole(tat_us)
  whole(frac)
  whole(exp_us)
  if not (tat_us < LAST_US and frac < EXACT and exp_us <= tat_us + (SLACK_MS + 1) * 1000) then
    corrupt()
  end
  local ahead = tat_us - now
  -- frac < count, in units of 1/count us, unless a gate of a higher rate count wrote it in
  -- its own finer units (a rolling deploy that lowered the count): read in this gate's, it
  -- would be up to (that count / this count) us of debt that is not there. The TAT then lies
  -- less than 1 us after tat_us, and is taken to be there (never earlier than it is).
  if frac >= count then
    ahead = ahead + 1
    frac = 0
  end
  if ahead < 0 then
    return 0, exp_us
  end
  return math.min(ahead * count + frac, EXACT), exp_us
end

-- Store the bucket with fill `used` at `now`. `explicit`: logical time (differential tests),
-- which runs far ahead of the clock that expires keys: every write sets a TTL of a minute.
local function bucket_write(key, now, count, used, exp_us, explicit)
  local ahead = math.floor(used / count)
  local frac = used - ahead * count
  local tat_us = now + ahead
  if explicit then
    redis.call('SET', key, struct.pack('<Bddd', 0, tat_us, frac, 0), 'PX', ttl_ms(0, true))
  elseif tat_us < exp_us then
    -- Full again at tat_us + frac/count <= tat_us + 1 <= exp_us: the TTL still covers it.
    redis.call('SET', key, struct.pack('<Bddd', 0, tat_us, frac, exp_us), 'KEEPTTL')
  else
    local ttl = math.floor((ahead + 1000) / 1000) + SLACK_MS
    -- One millisecond of margin between Redis TIME and the clock that expires keys.
    local expires = now + (ttl - 1) * 1000
    redis.call('SET', key, struct.pack('<Bddd', 0, tat_us, frac, expires), 'PX', ttl)
  end
end

-- ceil(units / count): units of 1/count us as whole microseconds.
local function ceil_us(units, count)
  return math.floor((units + count - 1) / count)
end
