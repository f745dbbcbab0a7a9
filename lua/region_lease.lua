-- flowgate region lease record: written by lua/region_share.lua (the refresher), read there
-- and by lua/region_bucket.lua (every decision). Put after lua/prelude.lua.
--
-- The record, packed little-endian doubles:
--   <seq, share, tau, expires_us, start_us, then up to HISTORY past segments
--    (start_us, share, tau), newest first>
-- The lease's share and bucket size tau apply from start_us until expires_us (this Redis's
-- clock; after that the region admits at its safe share); a past segment applied from its
-- start_us until the start of the segment after it. A renewal at the same share keeps
-- start_us. The history is what a bucket left untouched for a while is refilled along
-- (lua/region_bucket.lua): at the shares the region held meanwhile, not only at the ones
-- it held at both ends of the gap (a share that dipped in between, to 0 even, took the
-- region's tokens with it; a key first seen after a share grew starts from the smaller
-- bucket, not from a full new one).
-- A record of 4 doubles (written before there was a history, by an older version's
-- refresher in a rolling deploy) reads as start_us 0 and no history: the share held since
-- ever for a key without a bucket, as those records were read; a bucket written before is
-- refilled as that version did, at the lower of its own share and the record's (refill).

local HISTORY = 6

-- The lease in `raw` (a table: seq, share, tau, expires, start, past), or nil when `raw`
-- is not a record of this shape.
local function read_lease(raw)
  local len = #raw
  if len ~= 32 and (len < 40 or (len - 40) % 24 ~= 0) then
    return nil
  end
  local seq, share, tau, expires, pos = struct.unpack('<dddd', raw)
  local lease = {seq = seq, share = share, tau = tau, expires = expires, start = 0, past = {}}
  if len > 32 then
    lease.start, pos = struct.unpack('<d', raw, pos)
    while pos <= len do
      local s, sh, t
      s, sh, t, pos = struct.unpack('<ddd', raw, pos)
      lease.past[#lease.past + 1] = {s, sh, t}
    end
  end
  return lease
end

-- The lease at `key`, or nil if there is none; an unreadable record (of another type too:
-- a bare WRONGTYPE would not say which key) is an error naming it.
local function get_lease(key)
  local got, raw = pcall(redis.call, 'GET', key)
  if not got then
    error('region lease record is unreadable: delete ' .. key)
  end
  if not raw then
    return nil
  end
  local ok, lease = pcall(read_lease, raw)
  if not ok or not lease or type(lease.expires) ~= 'number' then
    error('region lease record is unreadable: delete ' .. key)
  end
  return lease
end

-- Write `lease` at `key`, kept `px` ms (nil: for ever).
local function set_lease(key, lease, px)
  local parts = {struct.pack('<ddddd', lease.seq, lease.share, lease.tau, lease.expires,
    lease.start)}
  for _, p in ipairs(lease.past) do
    parts[#parts + 1] = struct.pack('<ddd', p[1], p[2], p[3])
  end
  if px then
    redis.call('SET', key, table.concat(parts), 'PX', px)
  else
    redis.call('SET', key, table.concat(parts))
  end
end

-- Put the segment (start, share, tau), which ended when the next one began, in front of
-- the past ones. Past HISTORY, two adjacent ones become one, from the older start, at the
-- lower share and the smaller bucket: a bucket refilled across them gains no more than it
-- could have. The two whose merge loses the least refill (the difference of their shares
-- over the length of the higher one; the oldest such pair on a tie; the segment just put
-- in front stays as it is), so that a share that moves a little at every refresh keeps
-- what it refilled: merging the two oldest, a small first lease spread its share over all
-- but the last HISTORY segments.
local function push_past(lease, start, share, tau)
  local past = lease.past
  table.insert(past, 1, {start, share, tau})
  if #past > HISTORY then
    local at, least = #past - 1, math.huge
    for j = 2, #past - 1 do
      local newer, older = past[j], past[j + 1]
      local higher
      if newer[2] > older[2] then
        higher = past[j - 1][1] - newer[1]
      else
        higher = newer[1] - older[1]
      end
      local loss = math.abs(newer[2] - older[2]) * math.max(0, higher)
      if loss <= least then
        at, least = j, loss
      end
    end
    local newer, older = past[at], past[at + 1]
    past[at] = {older[1], math.min(newer[2], older[2]), math.min(newer[3], older[3])}
    table.remove(past, at + 1)
  end
end

-- The segments a region's bucket was refilled along, newest first, each {start, share, tau}:
-- the lease (and after it, once it expired, the safe share), then its past. Without a
-- record, the safe share since ever.
local function segments(lease, now, safe, safe_tau)
  if not lease then
    return {{0, safe, safe_tau}}
  end
  local segs = {}
  if now >= lease.expires then
    segs[1] = {lease.expires, safe, safe_tau}
  end
  segs[#segs + 1] = {lease.start, lease.share, lease.tau}
  for _, p in ipairs(lease.past) do
    segs[#segs + 1] = p
  end
  return segs
end

-- What a bucket holding `held` units at `from` holds at `now`: refilled segment by segment at
-- each one's share, never above each one's bucket (a segment of no length still caps it).
-- Before the oldest segment the shares are unknown: a bucket from then is taken as empty at
-- that segment's start. A bucket written at share `share_then` with size `tau_then` (nil for
-- a key without one) is refilled in the segment it was written in at most at those: they
-- are that segment's own, unless the record does not say when its share began (a record of
-- 4 doubles, or one such a record became; a region's first lease, for a bucket written at
-- the safe share before it), and then the share may have changed to it at any time since
-- the bucket was written.
local function refill(segs, from, held, now, share_then, tau_then)
  local n = #segs
  if from < segs[n][1] then
    from, held = segs[n][1], 0
  end
  for i = n, 1, -1 do
    local seg = segs[i]
    local stop = now
    if i > 1 then
      stop = segs[i - 1][1]
    end
    -- A segment that ended before `from` is behind it; the lease in force now always
    -- counts. One that ended at `from` still caps the bucket (a merged one may hold a
    -- change of no length at `from`; else the bucket went through its cap already).
    if i == 1 or stop >= from then
      local share, tau = seg[2], seg[3]
      if share_then and seg[1] < from then
        share, tau = math.min(share, share_then), math.min(tau, tau_then)
      end
      local gained = math.max(0, stop - math.max(seg[1], from)) * share
      held = math.min(tau, held + gained)
    end
  end
  return held
end
