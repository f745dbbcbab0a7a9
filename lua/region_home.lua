-- flowgate region home: the leases of a global quota shared by regions, kept in one hash in
-- the home Redis (the single writer). The same steps as flowgate::region::model::Home, which
-- is the reference: tests/region/model.rs runs both on the same traces. lua/prelude.lua is
-- put in front (clock_us).
--
-- KEYS[1]   the hash: field 'meta' = <learn_until_us, last_seq> and one field per region,
--           'r:<name>' = <prev_seq, prev_share, prev_until, last_seq, last_share, last_until,
--           demand, seen_us>, packed little-endian doubles (every value an integer < 2^53);
--           a seq of 0 means no grant. The live grants of regions the caller does not list
--           count as held too; their records are dropped once they hold none and their
--           demand is stale
-- ARGV[1]   mode: 'refresh', 'ack', 'init' or 'status'
-- ARGV[2]   now in us, for the model tests only; empty in production: Redis TIME is used
-- ARGV[3]   the index of the calling region (1-based; any for 'init' and 'status')
-- ARGV[4-6] its report: the seq of the lease it holds, the share it admits at, its demand
-- ARGV[7]   capacity (units per period)
-- ARGV[8]   policy: 0 static, 1 fair share, 2 proportional share
-- ARGV[9]   lease length, us
-- ARGV[10]  how long a reported demand counts, us
-- ARGV[11]  k, the number of regions; then for each: name, weight, safe share
-- ARGV[12 + 3k]  the period of the caller's quota in us (absent: not checked). The hash
--           keeps it in field 'period': the shares and demands it holds are units of that
--           period, so a caller whose quota has another period (the same rate written per
--           minute instead of per second) is refused while any region holds a grant above
--           0 (a status, always), and the hash takes its period once none does
--
-- refresh: {seq, share, until_us - now_us, learning, now_us}
-- ack:     {learning, now_us}
-- init:    {1 if the home started now without a learning phase, 0 if it had state}
-- status:  {learning (1 for a home without state: its first refresh starts the phase),
--           now_us, then per region: held, prev_share, last_share,
--           last_until_us - now_us (0: none), demand, now_us - seen_us (-1: never)}

local mode = ARGV[1]
local now = clock_us(ARGV[2])
local i = tonumber(ARGV[3])
local rep_seq, rep_share, rep_demand = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local capacity = tonumber(ARGV[7])
local policy = tonumber(ARGV[8])
local ttl = tonumber(ARGV[9])
local stale = tonumber(ARGV[10])
local k = tonumber(ARGV[11])
local home = KEYS[1]
local period = ARGV[12 + 3 * k]

local names, weights, safes = {}, {}, {}
for j = 1, k do
  names[j] = 'r:' .. ARGV[9 + 3 * j]
  weights[j] = tonumber(ARGV[10 + 3 * j])
  safes[j] = tonumber(ARGV[11 + 3 * j])
end

-- The state survives a week (at least four lease lengths) without a write: only an
-- allocator no longer in use loses it. A home without state cannot tell an expiry from a
-- restart that lost it, so a fleet that comes back to it learns for one lease length (every
-- region at its safe share): a fleet idle for a night or a weekend must not.
local function keep()
  redis.call('PEXPIRE', home, math.max(7 * 24 * 3600 * 1000, math.floor(4 * ttl / 1000)))
end

local unreadable = 'ERR region home state is unreadable: delete ' .. home
local meta = redis.call('HGET', home, 'meta')
local learn_until, last_seq
if not meta and mode == 'status' then
  -- No state: nothing is known but the safe shares; reading changes nothing. Learning: the
  -- first refresh starts the phase (only 'init' starts a home without it).
  local out = {1, now}
  for j = 1, k do
    for _, v in ipairs({safes[j], 0, 0, 0, 0, -1}) do
      out[#out + 1] = v
    end
  end
  return out
end
if meta then
  local _
  _, learn_until, last_seq = pcall(struct.unpack, '<dd', meta)
  if type(learn_until) ~= 'number' or type(last_seq) ~= 'number' then
    return redis.error_reply(unreadable)
  end
else
  -- No state: a first start or a restart that lost it. Unless told this is a first start,
  -- learn for one lease length: every lease granted before the loss has expired by then.
  learn_until = (mode == 'init') and 0 or (now + ttl)
  last_seq = 0
  redis.call('HSET', home, 'meta', struct.pack('<dd', learn_until, last_seq))
  keep()
  if mode == 'init' then
    return {1}
  end
end
if mode == 'init' then
  return {0}
end
local learning = now < learn_until

-- A region's record (nil: none yet) with expired grants forgotten; nil if unreadable.
local function read_region(raw)
  local r = {ps = 0, pn = 0, pu = 0, ls = 0, ln = 0, lu = 0, demand = 0, seen = 0}
  if raw then
    local ok, a, b, c, d, e, f, g, h = pcall(struct.unpack, '<dddddddd', raw)
    if not ok or type(h) ~= 'number' then
      return nil
    end
    r = {ps = a, pn = b, pu = c, ls = d, ln = e, lu = f, demand = g, seen = h}
  end
  if r.ps > 0 and r.pu <= now then
    r.ps, r.pn, r.pu = 0, 0, 0
  end
  if r.ls > 0 and r.lu <= now then
    r.ls, r.ln, r.lu = 0, 0, 0
  end
  return r
end

-- Every region's record: the caller's list, and the regions in the hash it does not list
-- (a deploy that adds or removes a region runs processes with both lists). Their live
-- grants count as held (`unlisted`): granting them to the listed regions would break the
-- bound. One the caller does not list whose grants have ended and whose demand is stale
-- is forgotten, so the hash keeps only the regions in use. (Only the listed ones' safe
-- shares are known: see the module docs on adding and removing a region.)
local listed = {}
for j = 1, k do
  listed[names[j]] = j
end
local all = redis.call('HGETALL', home)
local raw, unlisted, forget = {}, 0, {}
for n = 1, #all, 2 do
  local field = all[n]
  local j = listed[field]
  if j then
    raw[j] = all[n + 1]
  elseif string.sub(field, 1, 2) == 'r:' then
    local r = read_region(all[n + 1])
    if not r then
      return redis.error_reply(unreadable)
    end
    if r.ps == 0 and r.ls == 0 and not (now < r.seen + stale) then
      forget[#forget + 1] = field
    else
      unlisted = unlisted + math.max(r.pn, r.ln)
    end
  end
end
local rs = {}
for j = 1, k do
  rs[j] = read_region(raw[j])
  if not rs[j] then
    return redis.error_reply(unreadable)
  end
end
-- Shares are units of the period: one of another period would be read as a larger or a
-- smaller rate than it is (300 per second read as 300 of 18 000 per minute).
-- A status in another period would show the shares as that period's: refused too.
if period then
  local stored = redis.call('HGET', home, 'period')
  if stored ~= period then
    if stored then
      local live = mode == 'status' or unlisted > 0
      for j = 1, k do
        if math.max(rs[j].pn, rs[j].ln) > 0 then
          live = true
        end
      end
      if live then
        return redis.error_reply('ERR region home holds shares per ' .. stored ..
          ' us, this quota is per ' .. period .. ' us: it is refused until the grants ' ..
          'of the other period have ended')
      end
    end
    if mode ~= 'status' then
      redis.call('HSET', home, 'period', period)
    end
  end
end
if mode ~= 'status' then
  for _, field in ipairs(forget) do
    redis.call('HDEL', home, field)
  end
end

local function held(j)
  local r = rs[j]
  return math.max(safes[j], r.pn, r.ln)
end

local function save(j)
  local r = rs[j]
  redis.call('HSET', home, names[j],
    struct.pack('<dddddddd', r.ps, r.pn, r.pu, r.ls, r.ln, r.lu, r.demand, r.seen))
  keep()
end

if mode == 'status' then
  local out = {learning and 1 or 0, now}
  for j = 1, k do
    local r = rs[j]
    out[#out + 1] = held(j)
    out[#out + 1] = r.pn
    out[#out + 1] = r.ln
    out[#out + 1] = r.ls > 0 and (r.lu - now) or 0
    out[#out + 1] = r.demand
    out[#out + 1] = r.seen > 0 and (now - r.seen) or -1
  end
  return out
end

-- The report: holding the last grant (or newer) proves the one before it unused.
local me = rs[i]
if me.ls > 0 and rep_seq >= me.ls then
  me.ps, me.pn, me.pu = 0, 0, 0
end
me.demand = rep_demand
me.seen = now

if mode == 'ack' then
  save(i)
  return {learning and 1 or 0, now}
end

-- Still two live grants: the region gets the last one again.
if me.ps > 0 and me.ls > 0 then
  save(i)
  return {me.ls, me.ln, me.lu - now, learning and 1 or 0, now}
end

-- Targets: the policy over the capacity left after the safe shares.
local safe_total = 0
for j = 1, k do
  safe_total = safe_total + safes[j]
end
local free = math.max(0, capacity - safe_total)
local wants = {}
for j = 1, k do
  local r = rs[j]
  if r.seen > 0 and now < r.seen + stale then
    -- want(demand) = demand + max(1, floor(demand / 8)), minus the safe share
    wants[j] = math.max(0, r.demand + math.max(1, math.floor(r.demand / 8)) - safes[j])
  else
    wants[j] = 0
  end
end

-- Each part rounded down, then the units left one each to the largest remainders (ties to
-- the first listed), as the model: the parts add up to the whole of `free`.
local function by_weight(ws)
  local total = 0
  for j = 1, k do
    total = total + ws[j]
  end
  local out, rems, order, given = {}, {}, {}, 0
  for j = 1, k do
    out[j] = total == 0 and 0 or math.floor(free * ws[j] / total)
    rems[j] = free * ws[j] - out[j] * total
    order[j] = j
    given = given + out[j]
  end
  if total == 0 then
    return out
  end
  table.sort(order, function(a, b)
    if rems[a] ~= rems[b] then
      return rems[a] > rems[b]
    end
    return a < b
  end)
  for n = 1, free - given do
    out[order[n]] = out[order[n]] + 1
  end
  return out
end

local parts
if policy == 0 then
  parts = by_weight(weights)
elseif policy == 1 then
  local order = {}
  for j = 1, k do
    order[j] = j
  end
  table.sort(order, function(a, b)
    if wants[a] ~= wants[b] then
      return wants[a] < wants[b]
    end
    return a < b
  end)
  parts = {}
  local left = free
  for n, j in ipairs(order) do
    local give = math.min(wants[j], math.floor(left / (k - n + 1)))
    parts[j] = give
    left = left - give
  end
else
  local total = 0
  for j = 1, k do
    total = total + wants[j]
  end
  if total <= free then
    parts = wants
  else
    parts = by_weight(wants)
  end
end

local others = unlisted
for j = 1, k do
  if j ~= i then
    others = others + held(j)
  end
end
local share = math.min(parts[i] + safes[i], math.max(0, capacity - others))
if learning then
  share = math.min(share, rep_share)
end
-- Later than every grant of this home, and than the lease the region holds.
local seq = math.max(now, last_seq + 1, rep_seq + 1)
redis.call('HSET', home, 'meta', struct.pack('<dd', learn_until, seq))
-- The last grant becomes the one before; if it expired, a live one before stays counted.
if me.ls > 0 then
  me.ps, me.pn, me.pu = me.ls, me.ln, me.lu
end
me.ls, me.ln, me.lu = seq, share, now + ttl
save(i)
return {seq, share, ttl, learning and 1 or 0, now}
