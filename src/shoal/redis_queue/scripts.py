"""The job queue's Lua: the prelude every job script starts with, and the scripts of
waiting jobs.

Each step of a job's life is one atomic script. The steps of a job that waits are here:
``ENQUEUE`` (it starts to wait, in fair order), ``POSITIONS`` (the places of waiting jobs),
``CANCEL`` (of a waiting job, or telling a running job's holder), ``SETTLE`` (a key's finish
tag moved by the work a job did), ``COUNTS`` and ``WAITING`` (how many wait, per queue).
Claiming is ``TAKE`` (``claim``); what a job's holder does then, under its lease, is
``leases``. All of them share the job's state changes, written once in ``PRELUDE``
(start or stop waiting, start running, finish), since a job goes back to wait from a lease
and ends from either side.

Every job script starts with ``PRELUDE``, which names the common arguments (ARGV[1..7]:
group, consumer, job key prefix, output suffix, output MAXLEN, output TTL, finished TTL);
a script's own arguments start at ARGV[8]. Key names come from ``keys``: the queue
streams are passed in, job keys are the job key prefix plus an id read from Redis.

Every script is safe to run twice with the same arguments (redis-py re-sends a command
whose connection broke, and ``retrying`` does too): enqueue is keyed by job id, a claim
returns a job this consumer already holds, and each published event carries a sequence
number that is written once.

Job states (the hash field ``state``)::

    waiting ──claim──▶ running ──final event──▶ succeeded | failed
       ▲                  │ │ └──cancel──▶ cancelled (holder told; it acks)
       │                  │ └──holder lost after publishing output──▶ failed (502)
       └─requeue/reclaim──┘  (only while nothing was published: ``started`` unset)
    waiting ──cancel──▶ cancelled

A waiting job is a member of its queue's sorted set (``qr``, or ``qb`` for batch work not aged yet),
scored by its start tag: start-time fair queueing between API keys, the same arithmetic as
``router/dispatch/fair_queue.py`` (checked against it with hypothesis in
``tests/redis_queue/test_redis_fairness.py``). ``enwait`` computes the tag as the job starts to
wait; ``TAKE`` (``claim``) takes the smallest tag, moves the virtual time and gives the job a
stream entry delivered to the claiming consumer in the same script: the lease. A queue entry lives
from that claim until its job ends or goes back to wait (first in its class, as
``FairQueue.push_front``), when it is deleted. Every count of waiting jobs (per queue, per key)
changes in the same script as the job's state.
"""

from __future__ import annotations

PRELUDE = """
local G, C, JP, OS = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local OUTMAX, OUTTTL, FINTTL = ARGV[5], ARGV[6], ARGV[7]

local function emit(id, payload)
  local out = JP .. id .. OS
  redis.call('XADD', out, 'MAXLEN', '~', OUTMAX, '*', 'e', payload)
  redis.call('PEXPIRE', out, OUTTTL)
end

-- forget a queue entry: no longer pending for anyone, no longer waiting
local function drop(q, entry)
  redis.call('XACK', q, G, entry)
  redis.call('XDEL', q, entry)
end

-- a final state: keep the hash and the output a little longer for late readers
local function finish(id, state)
  redis.call('HSET', JP .. id, 'state', state)
  redis.call('PEXPIRE', JP .. id, FINTTL)
  redis.call('PEXPIRE', JP .. id .. OS, FINTTL)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- numbers written to Redis keep every bit (tostring would keep 14 digits)
local function fmt(x) return string.format('%.17g', x) end

-- key `who`'s jobs waiting: in the queue's fairness state and over every queue
local function tally(fair, kw, who, d)
  if redis.call('HINCRBY', fair, 'n:' .. who, d) <= 0 then redis.call('HDEL', fair, 'n:' .. who) end
  if redis.call('HINCRBY', kw, who, d) <= 0 then redis.call('HDEL', kw, who) end
end

local WAITF = {'ready', 'batch', 'aging', 'fair', 'kw', 'wake', 'tenant', 'weight', 'work',
               'prio', 'mode'}

-- the job starts to wait: start tag S = max(V, F[key]), F[key] = S + max(work, 1) / weight
-- (fair_queue.FairQueue._tag); `front`: put back, first in its class (push_front). The
-- member sorts equal tags by arrival; fifo mode scores every job 0 (arrival order only).
local function enwait(id, front)
  local j = JP .. id
  local f = redis.call('HMGET', j, unpack(WAITF))
  local fair, who = f[4], f[7]
  local v = tonumber(redis.call('HGET', fair, 'v') or '0')
  local tag, seq = v, 0
  if front then
    seq = 1e15 - redis.call('HINCRBY', fair, 'front', 1)
    redis.call('HDEL', j, 'for')  -- put back: any consumer may take it
  else
    seq = 1e15 + redis.call('HINCRBY', fair, 'seq', 1)
    local last = redis.call('HGET', fair, 'f:' .. who)
    if last then tag = math.max(v, tonumber(last)) end
    redis.call('HSET', fair, 'f:' .. who, fmt(tag + math.max(tonumber(f[9]), 1) / tonumber(f[8])))
  end
  local fifo = f[11] == 'fifo'
  local score = (fifo and 0) or tag
  local member = string.format('%016d:%s:%s', seq, id, who)
  local now = now_ms()
  if fifo or f[10] ~= 'batch' then
    redis.call('ZADD', f[1], fmt(score), member)
  else
    redis.call('ZADD', f[2], fmt(score), member)
    redis.call('ZADD', f[3], now, member)
  end
  redis.call('HSET', j, 'state', 'waiting', 'entry', '', 'owner', '', 'tag', fmt(tag),
             'member', member, 'since', now)
  tally(fair, f[5], who, 1)
  redis.call('XADD', f[6], 'MAXLEN', 16, '*', 'j', id)  -- wakes blocked claimers
end

-- the job no longer waits (claimed, cancelled, withdrawn); false if it was not waiting
local function unwait(id)
  local f = redis.call('HMGET', JP .. id, 'ready', 'batch', 'aging', 'fair', 'kw', 'tenant',
                       'member')
  if not f[7] then return false end
  local n = redis.call('ZREM', f[1], f[7]) + redis.call('ZREM', f[2], f[7])
  redis.call('ZREM', f[3], f[7])
  if n > 0 then tally(f[4], f[5], f[6], -1) end
  return n > 0
end

-- batch jobs that waited `aging_ms` compete with interactive ones (by their start tag)
local function promote(ready, batch, aging, now, aging_ms)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', aging, '-inf', now - aging_ms)) do
    local s = redis.call('ZSCORE', batch, m)
    if s then
      redis.call('ZADD', ready, s, m)
      redis.call('ZREM', batch, m)
    end
    redis.call('ZREM', aging, m)
  end
end

-- put a job back in its queue, first in its class (its lease entry is deleted)
local function requeue(q, entry, id)
  drop(q, entry)
  enwait(id, true)
end

local FIELDS = {'state', 'entry', 'owner', 'attempt', 'model', 'endpoint', 'stream', 'body',
                'seq', 'started', 'resume', 'need'}

-- hand a job to consumer C; nil if the entry is stale (job ended, cancelled, moved, expired)
local function start(q, entry, id, reclaiming)
  local j = JP .. id
  local f = redis.call('HMGET', j, unpack(FIELDS))
  if f[2] ~= entry then drop(q, entry) return nil end
  local attempt = tonumber(f[4])
  if f[1] == 'running' and not reclaiming then
    if f[3] == C then  -- ours already: a re-sent call
      return {id, q, entry, attempt, f[5], f[6], f[7], f[8], f[9], f[11] or '', f[12] or '0'}
    end
    return nil  -- taken over by another consumer while this call was delayed: theirs now
  end
  if f[1] ~= 'waiting' and f[1] ~= 'running' then
    drop(q, entry)  -- ended or cancelled
    return nil
  end
  attempt = attempt + 1
  redis.call('HSET', j, 'state', 'running', 'owner', C, 'attempt', attempt)
  emit(id, cjson.encode({t = 'assigned', consumer = C, attempt = attempt}))
  return {id, q, entry, attempt, f[5], f[6], f[7], f[8], f[9], f[11] or '', f[12] or '0'}
end

local function job_of(fields)
  for i = 1, #fields, 2 do
    if fields[i] == 'job' then return fields[i + 1] end
  end
  return nil
end
"""

ENQUEUE = (
    PRELUDE
    + """
-- KEYS: job hash, queue stream, queue registry, ready, batch, aging, fair, wake, per-key
-- counts. ARGV[8..]: max_len, job ttl, model, endpoint, stream flag, body, job id, key,
-- weight, class, work, mode (fair|fifo), the key's max_queued (-1: none), the consumer it
-- is held for ('' none) and for how many ms (``claim``), the tokens of context it
-- needs (0: any).
-- Returns {1 added | 0 duplicate | -1 queue full | -2 key over its cap, depth or its count}.
local depth = redis.call('XLEN', KEYS[2]) + redis.call('ZCARD', KEYS[4])
              + redis.call('ZCARD', KEYS[5])
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, depth} end
local max = tonumber(ARGV[8])
if max > 0 and depth >= max then return {-1, depth} end
local who, cap = ARGV[15], tonumber(ARGV[20])
local mine = tonumber(redis.call('HGET', KEYS[9], who) or '0')
if cap >= 0 and mine >= cap then return {-2, mine} end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'model', ARGV[10], 'endpoint', ARGV[11], 'stream', ARGV[12],
           'body', ARGV[13], 'queue', KEYS[2], 'ready', KEYS[4], 'batch', KEYS[5],
           'aging', KEYS[6], 'fair', KEYS[7], 'wake', KEYS[8], 'kw', KEYS[9],
           'tenant', who, 'weight', ARGV[16], 'prio', ARGV[17], 'work', ARGV[18],
           'mode', ARGV[19], 'attempt', 0, 'seq', 0, 'need', ARGV[23],
           'created', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
if ARGV[21] ~= '' then
  redis.call('HSET', KEYS[1], 'for', ARGV[21], 'until', now_ms() + tonumber(ARGV[22]))
end
redis.call('PEXPIRE', KEYS[1], ARGV[9])
redis.call('SADD', KEYS[3], KEYS[2])
enwait(ARGV[14], false)
return {1, depth + 1}
"""
)

POSITIONS = (
    PRELUDE
    + """
-- Places of waiting jobs: how many jobs of their queue go first. ARGV[8] batch aging in ms,
-- ARGV[9..] job ids. Per job its place, or -1 if it does not wait.
local now, aging_ms = now_ms(), tonumber(ARGV[8])
local promoted, res = {}, {}
for i = 9, #ARGV do
  local f = redis.call('HMGET', JP .. ARGV[i], 'state', 'ready', 'batch', 'aging', 'member')
  local place = -1
  if f[1] == 'waiting' and f[5] then
    if not promoted[f[2]] then
      promote(f[2], f[3], f[4], now, aging_ms)
      promoted[f[2]] = true
    end
    local r = redis.call('ZRANK', f[2], f[5])
    if r then
      place = r
    else
      local b = redis.call('ZRANK', f[3], f[5])
      if b then place = redis.call('ZCARD', f[2]) + b end
    end
  end
  res[#res + 1] = place
end
return res
"""
)

SETTLE = """
-- A job of key ARGV[1] (weight ARGV[2]) was charged ARGV[3] work and did ARGV[4]: move the
-- key's finish tag in the queue's fairness state KEYS[1] by the difference, never before V
-- (FairQueue.settle). Returns 1 if the key had a finish tag.
local f = redis.call('HGET', KEYS[1], 'f:' .. ARGV[1])
if not f then return 0 end
local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
local c = tonumber(f) + (tonumber(ARGV[4]) - tonumber(ARGV[3])) / tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'f:' .. ARGV[1], string.format('%.17g', math.max(c, v)))
return 1
"""

CANCEL = (
    PRELUDE
    + """
-- Cancel a job. ARGV[8] job id, ARGV[9] '1' to cancel only a waiting job, ARGV[10] and
-- ARGV[11] the consumer cancel-list key around the holder's name, ARGV[12] that list's TTL.
-- Returns the state found: waiting (removed), running (holder told), or another/missing.
local id = ARGV[8]
local f = redis.call('HMGET', JP .. id, 'state', 'entry', 'queue', 'owner')
if not f[1] then return 'missing' end
if f[1] == 'waiting' then
  unwait(id)
  finish(id, 'cancelled')
elseif f[1] == 'running' and ARGV[9] ~= '1' then
  redis.call('HSET', JP .. id, 'state', 'cancelled')
  local list = ARGV[10] .. f[4] .. ARGV[11]
  redis.call('RPUSH', list, id)
  redis.call('PEXPIRE', list, ARGV[12])
end
return f[1]
"""
)

COUNTS = """
-- KEYS: a queue's stream, ready and batch sets. Returns {waiting, running}.
return {redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3]), redis.call('XLEN', KEYS[1])}
"""

WAITING = """
-- KEYS[1] the set of queue stream names; ARGV[1..3] the stream, ready and batch key prefixes,
-- ARGV[4] the job key prefix. Returns {now in ms, queue, waiting, since, ...} for every queue
-- in the set (read by name: a single Redis), `since` the ms its longest-waiting job started to
-- wait (-1: none waits). O(waiting jobs): one HGET each, once per heartbeat interval.
local t = redis.call('TIME')
local res = {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
for _, q in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local suffix = string.sub(q, #ARGV[1] + 1)
  local n, since = 0, -1
  for _, set in ipairs({ARGV[2] .. suffix, ARGV[3] .. suffix}) do
    for _, m in ipairs(redis.call('ZRANGE', set, 0, -1)) do
      n = n + 1
      local id = string.match(m, '^%d+:([^:]+):')
      local at = id and tonumber(redis.call('HGET', ARGV[4] .. id, 'since'))
      if at and (since < 0 or at < since) then since = at end
    end
  end
  res[#res + 1] = q
  res[#res + 1] = n
  res[#res + 1] = since
end
return res
"""
