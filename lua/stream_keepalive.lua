-- flowgate Redis Streams keep-alive: a live consumer resets the idle time of the pending
-- entries it still holds, so no other consumer's XAUTOCLAIM takes them while it works on
-- them. Claiming then only takes entries of consumers that stopped (and entries dropped
-- unacknowledged, whose ids are no longer sent here).
--
-- KEYS[1]  the stream
-- ARGV[1]  the group
-- ARGV[2]  this consumer
-- ARGV[3…] ids this consumer handed out and the application still holds, or acknowledged
--          with their XACK not sent yet
--
-- An entry is touched only while this consumer still owns it: one another consumer claimed
-- meanwhile (this one stalled past min_idle) is left alone, so the keep-alive never steals.
-- XCLAIM … JUSTID resets the idle time without counting a delivery. Returns how many
-- entries were touched.

local touched = 0
for i = 3, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  local entry = pending[1]
  if entry and entry[2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    touched = touched + 1
  end
end
return touched
