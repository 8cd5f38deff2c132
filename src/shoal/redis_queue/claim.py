"""Claiming jobs from the Redis queue (``TAKE``), with holds for the consumer whose worker
holds a job's prefix.

With several routers on one Redis, the router a request reached knows (from the worker
directory) which worker already holds the request's prefix in its llama-server
(``router.dispatch.scheduler.hold_for``). It enqueues the job held for the consumer that
claims that worker's jobs: its router, or a pull worker itself (the job hash's ``for``, a
consumer name, and ``until``, Redis time in ms: ``ENQUEUE`` in ``scripts``). ``TAKE``
passes over a job held for another consumer until its hold ends, and takes the next one, so
a job waits only a short, bounded time for the consumer that can answer it from cache, and
never waits behind another's claim loop: the consumer it is held for takes it as soon as it
has a free slot (it is woken by the job's arrival, as every claimer is), and when the hold
ends anyone takes it (a claimer that passed over a hold blocks no longer than the hold has
left). A job put back in its queue loses its hold.

A claimer also says, per queue, the most context its slots have (``limit``, in tokens; 0:
any): ``TAKE`` passes over a job that needs more (the job hash's ``need``, from ``ENQUEUE``,
raised by ``GIVE_BACK`` when a worker's llama-server refused its prompt as too long), which
waits for a claimer with a slot that holds it. Like a hold, a job passed over costs a
claimer one look, at most ``HELD_SCAN`` of them per class.
"""

from __future__ import annotations

from shoal.redis_queue.scripts import PRELUDE

TAKE = (
    PRELUDE
    + """
-- Take up to ARGV[8] waiting jobs for C, without blocking: in each queue the smallest start
-- tag (interactive and aged batch first), across queues the head that waited longest.
-- ARGV[9]: batch aging in ms; ARGV[10..]: per queue, the most tokens of context a job taken
-- may need (0 or none: any). KEYS[1]: the per-key counts; then per queue its six keys
-- (stream, ready, batch, aging, fair, wake). Returns {jobs taken, per queue the last
-- wake-up id, ms until the first hold passed over ends (0: none)}: a claimer that got
-- nothing blocks on the wake streams from those ids, for at most those ms.
local count, aging_ms, kw = tonumber(ARGV[8]), tonumber(ARGV[9]), KEYS[1]
local now = now_ms()
local qs = {}
for i = 2, #KEYS, 6 do
  local Q = {q = KEYS[i], ready = KEYS[i + 1], batch = KEYS[i + 2], aging = KEYS[i + 3],
             fair = KEYS[i + 4], wake = KEYS[i + 5],
             limit = tonumber(ARGV[10 + (i - 2) / 6] or '0')}
  if redis.call('EXISTS', Q.q) == 0 then
    redis.call('XGROUP', 'CREATE', Q.q, G, '$', 'MKSTREAM')
  end
  promote(Q.ready, Q.batch, Q.aging, now, aging_ms)
  qs[#qs + 1] = Q
end

-- the next job of a queue C may take; members whose job expired are forgotten with their
-- count. A job held for another consumer (its fields ``for`` and ``until``) is passed over
-- until its hold ends, and one that needs more context than the queue's limit for good, at
-- most HELD_SCAN of them per class; `soonest` is when the first of those holds ends.
local HELD_SCAN, soonest = 32, nil
local function head(Q)
  for cls, z in ipairs({Q.ready, Q.batch}) do
    local skip = 0
    while skip < HELD_SCAN do
      local r = redis.call('ZRANGE', z, skip, skip)
      if #r == 0 then break end
      local m = r[1]
      local id, who = string.match(m, '^%d+:([^:]+):(.*)$')
      local f = redis.call('HMGET', JP .. id, 'state', 'member', 'since', 'tag', 'for', 'until',
                           'need')
      if f[1] == 'waiting' and f[2] == m then
        local ends = tonumber(f[6] or '0')
        local fits = Q.limit <= 0 or tonumber(f[7] or '0') <= Q.limit
        if fits and (not f[5] or f[5] == C or ends <= now) then
          return {cls = cls - 1, since = tonumber(f[3]), tag = tonumber(f[4]), m = m, id = id,
                  who = who}
        end
        if fits and (soonest == nil or ends < soonest) then soonest = ends end
        skip = skip + 1
      else
        redis.call('ZREM', Q.ready, m)
        redis.call('ZREM', Q.batch, m)
        redis.call('ZREM', Q.aging, m)
        tally(Q.fair, kw, who, -1)
      end
    end
  end
  return nil
end

-- a key whose finish tag is behind the virtual time starts at V anyway: its tag is
-- dropped unless it has jobs waiting (FairQueue._forget_idle)
local function forget(fair, v)
  local h = redis.call('HGETALL', fair)
  local busy = {}
  for i = 1, #h, 2 do
    if string.sub(h[i], 1, 2) == 'n:' then busy[string.sub(h[i], 3)] = true end
  end
  for i = 1, #h, 2 do
    local k = h[i]
    if string.sub(k, 1, 2) == 'f:' and not busy[string.sub(k, 3)]
       and tonumber(h[i + 1]) <= v then
      redis.call('HDEL', fair, k)
    end
  end
end

local taken, heads = {}, {}
for i, Q in ipairs(qs) do heads[i] = head(Q) end
while #taken < count do
  local best = nil
  for i = 1, #qs do
    local h, b = heads[i], heads[best or i]
    if h and (best == nil or h.cls < b.cls or (h.cls == b.cls and h.since < b.since)) then
      best = i
    end
  end
  if best == nil then break end
  local Q, h = qs[best], heads[best]
  redis.call('ZREM', Q.ready, h.m)
  redis.call('ZREM', Q.batch, h.m)
  redis.call('ZREM', Q.aging, h.m)
  tally(Q.fair, kw, h.who, -1)
  local v = tonumber(redis.call('HGET', Q.fair, 'v') or '0')
  if h.tag > v then
    v = h.tag
    redis.call('HSET', Q.fair, 'v', fmt(v))
  end
  forget(Q.fair, v)
  -- the lease: an entry delivered to C at once (every other entry was, when it was added)
  local entry = redis.call('XADD', Q.q, '*', 'job', h.id)
  while true do
    local e = redis.call('XREADGROUP', 'GROUP', G, C, 'COUNT', 1, 'STREAMS', Q.q, '>')[1][2][1]
    if e[1] == entry then break end
    drop(Q.q, e[1])  -- left by an older layout: no job waits on it
  end
  redis.call('HSET', JP .. h.id, 'entry', entry)
  local got = start(Q.q, entry, h.id, false)
  if got then taken[#taken + 1] = got end
  heads[best] = head(Q)
end
local cursors = {}
for i, Q in ipairs(qs) do
  local last = redis.call('XREVRANGE', Q.wake, '+', '-', 'COUNT', 1)
  cursors[i] = (#last > 0 and last[1][1]) or '0-0'
end
return {taken, cursors, (soonest and math.max(soonest - now, 1)) or 0}
"""
)
