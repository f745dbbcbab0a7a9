-- flowgate region bucket: a token bucket (GCRA) whose rate is the region's current share of
-- a global quota, read from the lease record in the same script. lua/prelude.lua is put in
-- front (clock_us, corrupt).
--
-- KEYS[1]  the lease record (lua/region_share.lua): <seq, share, tau, expires_us>
-- KEYS[2]  the demand counters: HINCRBY a (admitted) or r (rejected) by the cost
-- KEYS[3]  the bucket: <tat_us, frac, count, tau, written_us>, packed little-endian
--          doubles; frac is in units of 1/count us; count and tau are the share and bucket
--          size it was written at, written_us when
-- ARGV[1]  now in us, for the model tests only; empty in production: Redis TIME is used
-- ARGV[2]  cost
-- ARGV[3]  the quota's period, us
-- ARGV[4]  the safe share (units per period) and ARGV[5] its tau: what the region admits at
--          when it holds no live lease
-- ARGV[6]  retry_after (us) to answer while the share is 0
-- ARGV[7]  how long (ms) a full bucket is kept: the lease length, at least 1000
--
-- Time is measured in units of 1/share us: one token is `period` units, and the bucket holds
-- tau units (the region's part of the global burst, at least one token). When the share
-- changes, the bucket keeps the tokens it had in hand, refilled at the lower of the two
-- shares and at most the new bucket, so a region never gains tokens by a change. A cost
-- above the bucket at the current share is rejected with retry_after = ARGV[6]. At share 0
-- the bucket is stored empty. Returns {allowed, burst, remaining, retry_after_us,
-- reset_after_us}; a rejected request writes only the counter (and the bucket converted to
-- a new share, or emptied at share 0).

local now = clock_us(ARGV[1])
local cost = tonumber(ARGV[2])
local period = tonumber(ARGV[3])

local share, tau = tonumber(ARGV[4]), tonumber(ARGV[5])
local raw = redis.call('GET', KEYS[1])
if raw then
  local ok, _, s, t, expires = pcall(struct.unpack, '<dddd', raw)
  if not ok or type(expires) ~= 'number' then
    return redis.error_reply('ERR region lease record is unreadable: delete ' .. KEYS[1])
  end
  if now < expires then
    share, tau = s, t
  end
end

if share <= 0 then
  -- At share 0 the region holds no tokens: the bucket is stored empty (size 0), so when
  -- the share grows it is converted like any other (from nothing) instead of starting as
  -- a new, full bucket.
  redis.call('SET', KEYS[3], struct.pack('<ddddd', now, 0, 1, 0, now), 'PX',
    tonumber(ARGV[7]))
  redis.call('HINCRBY', KEYS[2], 'r', cost)
  return {0, 0, 0, tonumber(ARGV[6]), 0}
end

if cost * period > tau then
  -- More than the region's bucket holds at its share now: not before the share grows.
  redis.call('HINCRBY', KEYS[2], 'r', cost)
  return {0, math.floor(tau / period), 0, tonumber(ARGV[6]), 0}
end

-- Store the bucket with fill `used` (units of 1/share us) at now.
local function write(used)
  local ahead = math.floor(used / share)
  local frac = used - ahead * share
  -- Kept a lease length after it is full again: a share change within that time finds it
  -- (and converts it) instead of a new, full bucket.
  redis.call('SET', KEYS[3], struct.pack('<ddddd', now + ahead, frac, share, tau, now), 'PX',
    math.floor(ahead / 1000) + tonumber(ARGV[7]))
end

local used = 0
local converted = false
local state = redis.call('GET', KEYS[3])
if state then
  local ok, tat_us, frac, count, was_tau, written = pcall(struct.unpack, '<ddddd', state)
  local function finite(x)
    return type(x) == 'number' and x == x and x > -math.huge and x < math.huge
  end
  if not ok or not (finite(tat_us) and finite(frac) and finite(count) and finite(was_tau)
      and finite(written)) or not (count > 0) or not (frac >= 0) or not (frac < count)
      or not (was_tau >= 0) or not (written <= now + 60000000) or not (tat_us >= written) then
    -- This key only: the request fails with a key error, the gate stays healthy.
    return {KEY_CORRUPT, 0, 0, 0, 0}
  end
  if count == share and was_tau == tau then
    local ahead = tat_us - now
    if ahead > 0 or (ahead == 0 and frac > 0) then
      used = ahead * count + frac
    end
  else
    -- The share changed since the last write: the tokens in hand then (a token is `period`
    -- units at any share), refilled since at the lower of the two shares, at most the new
    -- bucket. A region never gains tokens by a change, so the regions together never hold
    -- more than their buckets, which add up to the global burst (and one request each).
    local in_hand = math.max(0, was_tau - ((tat_us - written) * count + frac))
    in_hand = math.min(was_tau, in_hand + math.max(0, now - written) * math.min(count, share))
    used = tau - math.min(tau, in_hand)
    converted = true
  end
end

local burst = math.floor(tau / period)
local used_after = used + cost * period
if used_after > tau then
  if converted then
    -- Refill at the new share from now on, admitted or not.
    write(used)
  end
  redis.call('HINCRBY', KEYS[2], 'r', cost)
  local held = math.min(used, tau)
  -- reset: all of `used`, which exceeds tau only if the clock stepped back.
  return {0, burst, math.floor((tau - held) / period),
    math.ceil((used_after - tau) / share), math.ceil(used / share)}
end
write(used_after)
redis.call('HINCRBY', KEYS[2], 'a', cost)
return {1, burst, math.floor((tau - used_after) / period), 0, math.ceil(used_after / share)}
