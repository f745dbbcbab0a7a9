-- flowgate region bucket: a token bucket (GCRA) whose rate is the region's current share of
-- a global quota, read from the lease record in the same script. lua/prelude.lua and
-- lua/region_lease.lua are put in front (clock_us, corrupt; the record).
--
-- KEYS[1]  the lease record (lua/region_lease.lua): the share, since when, and before
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
-- ARGV[7]  how long (ms) a full bucket is kept: the lease length and the time a bucket takes
--          to fill from empty (burst / rate), at least 1000, so that one drained just
--          before its share grew is kept until full at the new size too
-- ARGV[8]  how long (ms) the demand counters are kept when a decision makes them (absent:
--          for ever): as the refresher keeps them (lua/region_share.lua)
--
-- Time is measured in units of 1/share us: one token is `period` units, and the bucket holds
-- tau units (the region's part of the global burst, at least one token). When the share
-- changed since the bucket was written, the bucket keeps the tokens it had in hand,
-- refilled along the record's history: at each share the region held meanwhile, never above
-- each one's bucket (a dip to 0 empties it), so a region never gains tokens by a change. A
-- key with no bucket is one that has been full since ever, refilled the same way: after a
-- share grew it starts from the smaller bucket, not a full new one. A cost
-- above the bucket at the current share is rejected with retry_after = ARGV[6]. At share 0
-- the bucket is stored empty. Returns {allowed, burst, remaining, retry_after_us,
-- reset_after_us}; a rejected request writes only the counter (and the bucket converted to
-- a new share, or emptied at share 0).

local now = clock_us(ARGV[1])
local cost = tonumber(ARGV[2])
local period = tonumber(ARGV[3])

-- Count the request in the demand counters (`field`: a admitted, r rejected). The refresher
-- starts them and keeps them for ARGV[8]; counters this makes (the refresher has not
-- started them since this Redis restarted empty, or since they expired) are kept as long,
-- so a region whose refresher never reports again leaves nothing behind. Only the first
-- count of a field since the counters started can be on a key without a TTL.
local function count(field)
  if redis.call('HINCRBY', KEYS[2], field, cost) == cost and ARGV[8]
      and redis.call('PTTL', KEYS[2]) == -1 then
    redis.call('PEXPIRE', KEYS[2], ARGV[8])
  end
end

local ok, lease = pcall(get_lease, KEYS[1])
if not ok then
  return redis.error_reply('ERR ' .. tostring(lease))
end
-- Newest first: the first is in force now.
local segs = segments(lease, now, tonumber(ARGV[4]), tonumber(ARGV[5]))
local share, tau = segs[1][2], segs[1][3]

if share <= 0 then
  -- At share 0 the region holds no tokens: the bucket is stored empty (size 0), so when
  -- the share grows it is converted like any other (from nothing) instead of starting as
  -- a new, full bucket.
  redis.call('SET', KEYS[3], struct.pack('<ddddd', now, 0, 1, 0, now), 'PX',
    tonumber(ARGV[7]))
  count('r')
  return {0, 0, 0, tonumber(ARGV[6]), 0}
end

if cost * period > tau then
  -- More than the region's bucket holds at its share now: not before the share grows.
  count('r')
  return {0, math.floor(tau / period), 0, tonumber(ARGV[6]), 0}
end

-- Store the bucket with fill `used` (units of 1/share us) at now.
local function write(used)
  local ahead = math.floor(used / share)
  local frac = used - ahead * share
  -- Kept ARGV[7] after it is full again: a share change within that time finds it (and
  -- converts it), and a bucket drained before a share grew is kept until full at the new
  -- size, instead of coming back as a new, full bucket.
  redis.call('SET', KEYS[3], struct.pack('<ddddd', now + ahead, frac, share, tau, now), 'PX',
    math.floor(ahead / 1000) + tonumber(ARGV[7]))
end

local used = 0
local converted = false
local state = redis.call('GET', KEYS[3])
if not state then
  -- Full since ever, refilled along the history.
  used = tau - math.min(tau, refill(segs, 0, math.huge, now))
  converted = used > 0
else
  local ok, tat_us, frac, count, was_tau, written = pcall(struct.unpack, '<ddddd', state)
  local function finite(x)
    return type(x) == 'number' and x == x and x > -math.huge and x < math.huge
  end
  if not ok or not (finite(tat_us) and finite(frac) and finite(count) and finite(was_tau)
      and finite(written)) or not (count > 0) or not (frac >= 0) or not (frac < count)
      or not (was_tau >= 0) or not (written <= now + 60000000) or not (tat_us >= written)
      -- Past 2^53 no write puts them, and the arithmetic is not exact.
      or not (tat_us < 9007199254740992 and count < 9007199254740992
        and was_tau < 9007199254740992) then
    -- This key only: the request fails with a key error, the gate stays healthy.
    return {KEY_CORRUPT, 0, 0, 0, 0}
  end
  -- Written after the share in force began: nothing happened since. Written in the very
  -- microsecond it began, the bucket may predate it and the changes of no length before it
  -- (each caps the bucket): refilled along them, which costs nothing if it does not.
  if count == share and was_tau == tau and written > segs[1][1] then
    local ahead = tat_us - now
    if ahead > 0 or (ahead == 0 and frac > 0) then
      used = ahead * count + frac
    end
  else
    -- The share changed since the last write (maybe and back): the tokens in hand then (a
    -- token is `period` units at any share), refilled since along the history. A region
    -- never gains tokens by a change, so the regions together never hold more than their
    -- buckets, which add up to the global burst (and one request each).
    local in_hand = math.max(0, was_tau - ((tat_us - written) * count + frac))
    used = tau - math.min(tau, refill(segs, written, in_hand, now, count, was_tau))
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
  count('r')
  local held = math.min(used, tau)
  -- reset: all of `used`, which exceeds tau only if the clock stepped back.
  return {0, burst, math.floor((tau - held) / period),
    math.ceil((used_after - tau) / share), math.ceil(used / share)}
end
write(used_after)
count('a')
return {1, burst, math.floor((tau - used_after) / period), 0, math.ceil(used_after / share)}
