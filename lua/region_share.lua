-- flowgate region share: a region's lease in its local Redis, read and written by the
-- region's refresher (one process of the region at a time: the one holding the lock).
-- lua/prelude.lua and lua/region_lease.lua are put in front (clock_us, the record). The gates of every process of the region read
-- the same record in lua/region_bucket.lua, so they all admit at the same share, switched
-- at one instant by the local Redis clock.
--
-- KEYS[1]  the lease record (lua/region_lease.lua): the lease, since when it applies, and
--          the shares before it; times on this Redis's clock
-- KEYS[2]  the demand counters: a hash {a = units admitted, r = units rejected} since the
--          last report (written by lua/region_bucket.lua)
-- KEYS[3]  the refresher lock
-- ARGV[1]  mode: 'report', 'apply' or 'release'
-- ARGV[2]  now in us, for the model tests only; empty in production: Redis TIME is used
--
-- report: ARGV[3] this process's lock token, ARGV[4] the lock's length in ms, ARGV[5] a
--   refresh interval plus the home timeout and ARGV[6] the home timeout, in us, ARGV[7] how
--   long (ms) the record and the counters are kept (absent: for ever). Takes or
--   renews the lock: for ARGV[4], but while a lease is in force only until ARGV[5] before it
--   ends (at least ARGV[6]). The holder gets {1, now_us, seq, share, expires_us - now_us,
--   admitted, rejected, us since the counters started (-1: unknown), the lock's length in
--   ms}, and the counters start again from 0; another process gets {0, now_us, seq, share,
--   expires_us - now_us, 0, 0, -1, 0} (the lease, to show in its status).
--   now_us is the time the lease written by 'apply' will count from.
-- apply: ARGV[3] seq, ARGV[4] share, ARGV[5] tau, ARGV[6] expires_us (this Redis's clock),
--   ARGV[7] '1' for a grant of the home's learning phase, ARGV[8] and ARGV[9] the safe share
--   and its tau, ARGV[10] the seq the record held when the refresh began, ARGV[11] how long
--   (ms) the record is kept (absent: for ever). Writes the lease
--   unless the record holds a newer one (a larger seq): a late reply can never replace a
--   newer lease; nor when the record went back below ARGV[10] (lost writes). A learning grant
--   is capped at what the region admits at now (its lease if live, else its safe share).
--   A lease at another share than the one in force starts now, the one before it (and, if it
--   had expired, the safe share since) going to the record's history; a renewal keeps its
--   start. A lease already over when it lands is written ending now. The first lease a
--   region gets reads as held since ever.
--   {1, share written}, {0, 0} (a newer lease is there) or {0, -1} (the record went back).
-- release: ARGV[3] this process's lock token. Deletes the lock if this process holds it
--   (a process that stops, or cannot reach the home): {1} released, {0} not held.
--
-- The lease record and the counters are kept for ARGV[7] (report, by the holder) or
-- ARGV[11] (apply) from each write: a week, four lease lengths and twice as long as a
-- bucket is kept, whichever is longest (src/region/member.rs); counters a decision makes
-- (this Redis lost them) as long from then (lua/region_bucket.lua). A region no process
-- refreshes any more (its allocator no longer in use, or taken off the lists) leaves
-- nothing behind, and a record outlives its lease and every bucket it converts (gone
-- first, a bucket would be refilled as if the region had held a share meanwhile).

local mode = ARGV[1]
local now = clock_us(ARGV[2])

-- The lease record, read by record().
local held

local function record()
  held = get_lease(KEYS[1])
  if not held then
    return 0, 0, 0, 0
  end
  return held.seq, held.share, held.tau, held.expires
end

if mode == 'report' then
  local token = ARGV[3]
  local holder = redis.call('GET', KEYS[3])
  local seq, share, _, expires = record()
  if holder and holder ~= token then
    return {0, now, seq, share, expires - now, 0, 0, -1, 0}
  end
  -- A holder renews the lock at each refresh, also at one that gets no lease (its home call
  -- fails, or it dies first): counted from then, a lock that lapses for another process to
  -- take could lapse too late for that one's tick (within a refresh interval) and home call
  -- (within the home timeout) to renew the lease in force before it ends. It lapses in
  -- time for that, but lasts this refresh's own home call.
  local px = tonumber(ARGV[4])
  if expires > now then
    local lapse = math.max(expires - tonumber(ARGV[5]), now + tonumber(ARGV[6]))
    px = math.min(px, math.ceil((lapse - now) / 1000))
  end
  px = math.max(1, px)
  redis.call('SET', KEYS[3], token, 'PX', px)
  local keep = ARGV[7]
  if keep and held then
    redis.call('PEXPIRE', KEYS[1], keep)
  end
  local counts = redis.call('HMGET', KEYS[2], 'a', 'r', 't')
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 't', now)
  if keep then
    redis.call('PEXPIRE', KEYS[2], keep)
  end
  local since = counts[3] and (now - tonumber(counts[3])) or -1
  return {1, now, seq, share, expires - now, tonumber(counts[1] or 0), tonumber(counts[2] or 0),
    since, px}
end

if mode == 'release' then
  -- Give the refresher lock up, if this process (token ARGV[3]) holds it.
  if redis.call('GET', KEYS[3]) == ARGV[3] then
    redis.call('DEL', KEYS[3])
    return {1}
  end
  return {0}
end

local seq, share, tau, expires = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[6])
local held_seq, held_share, held_tau, held_expires = record()
if seq < held_seq then
  return {0, 0}
end
if held_seq < tonumber(ARGV[10]) then
  -- The record is older than when this refresh read it: this Redis lost writes (a restart
  -- without persistence, a failover to a replica behind). A reply in flight from before
  -- must not land on it; the next refresh starts from what is here now.
  return {0, -1}
end
if ARGV[7] == '1' then
  -- A grant of the home's learning phase: at most what the region admits at now.
  local now_share, now_tau = tonumber(ARGV[8]), tonumber(ARGV[9])
  if now < held_expires then
    now_share, now_tau = held_share, held_tau
  end
  if now_share < share then
    share, tau = now_share, now_tau
  end
end
-- A lease already over when it lands ends now, not at its expires_us: the one before it
-- was in force until now (the history must not have the safe share start before that).
expires = math.max(expires, now)
local lease = held
if not lease then
  lease = {start = 0, past = {}}
elseif now >= held_expires then
  -- The lease ran out before this one came: the safe share applied since.
  push_past(lease, lease.start, held_share, held_tau)
  push_past(lease, held_expires, tonumber(ARGV[8]), tonumber(ARGV[9]))
  lease.start = now
elseif share ~= held_share or tau ~= held_tau then
  push_past(lease, lease.start, held_share, held_tau)
  lease.start = now
end
lease.seq, lease.share, lease.tau, lease.expires = seq, share, tau, expires
set_lease(KEYS[1], lease, ARGV[11])
return {1, share}
