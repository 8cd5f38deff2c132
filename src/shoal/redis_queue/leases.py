"""The job queue's leases in Lua: what the consumer holding a job does with it, and taking a
lease over.

A claim (``TAKE``, ``claim``) gives a job an entry of its queue's stream, delivered to
the claiming consumer: that pending entry is the job's lease, and its idle time is how long
its holder has not renewed it. Every script here first checks that the job's hash still
names this consumer (``owner``) and that entry, so a holder whose lease was taken over while
it was away can no longer change the job, and only the lease's holder can end it:

* ``RENEW`` resets the idle time of the leases a holder still has (and tells it which jobs
  were cancelled);
* ``PUBLISH`` appends output events, keeps the trail of what the client has, and on the final
  event ends the job and deletes its entry;
* ``ACK`` ends a holder's jobs it is done with (failed if no final event came);
* ``GIVE_BACK`` puts a job that has not answered yet back to wait; ``GO_ON`` puts back one
  that answered in part, with the continuation its next holder goes on from;
* ``ADOPT`` takes a running job over from a holder whose worker now answers through this
  consumer; ``RECLAIM`` takes over the leases idle past their TTL, whose holder stopped
  renewing (``recovery``); ``PRUNE`` forgets consumers that hold no lease.

The waiting side (enqueue, places, cancel, counts) is ``scripts``, apart from these
because no lease fences it: anyone may enqueue, look or cancel. Every script here starts with
its ``PRELUDE`` (the common arguments and the job's state changes), and the job states and
the idempotence every script keeps are described there.
"""

from __future__ import annotations

from shoal.redis_queue.scripts import PRELUDE

RECLAIM = (
    PRELUDE
    + """
-- Take over entries of KEYS[1] idle for ARGV[8] ms (their holder stopped renewing).
-- ARGV[9] count, ARGV[10] '1' to run them here or '0' to put them back in the queue,
-- ARGV[11] XAUTOCLAIM cursor, ARGV[12] the Failed event for jobs that had started,
-- ARGV[13] the Requeued event, ARGV[14] resume attempts, ARGV[15] the Requeued event of a
-- job lost mid-answer that goes on from its trail (exact, a streamed chat or completion,
-- attempts left). Returns {next cursor, {kind, job id, start fields...}...}.
local function go_on(q, entry, id)
  local j = JP .. id
  local g = redis.call('HMGET', j, 'exact', 'ids', 'head', 'resume', 'stream', 'endpoint')
  if g[1] ~= '1' or g[5] ~= '1' or (g[6] ~= 'chat' and g[6] ~= 'completions') then
    return false
  end
  local n = 0
  if g[4] and g[4] ~= '' then n = tonumber(cjson.decode(g[4]).resumes) end
  if n >= tonumber(ARGV[14]) then return false end
  local head = {}
  if g[3] then head = cjson.decode(g[3]) end
  local answer_id, created = 'null', 'null'
  if type(head.id) == 'string' then answer_id = cjson.encode(head.id) end
  if type(head.created) == 'number' then created = string.format('%d', head.created) end
  requeue(q, entry, id)
  redis.call('HSET', j, 'resume', '{"resumes":' .. (n + 1) .. ',"resume":{"tokens":['
    .. (g[2] or '') .. '],"id":' .. answer_id .. ',"created":' .. created .. '}}')
  emit(id, ARGV[15])
  return true
end

local q = KEYS[1]
local r = redis.call('XAUTOCLAIM', q, G, C, ARGV[8], ARGV[11], 'COUNT', ARGV[9])
local res = {r[1]}
for _, e in ipairs(r[2]) do
  local entry, id = e[1], job_of(e[2])
  local f = {}
  if id then f = redis.call('HMGET', JP .. id, 'state', 'entry', 'started') end
  if (f[1] ~= 'running' and f[1] ~= 'waiting') or f[2] ~= entry then
    drop(q, entry)  -- ended, cancelled, moved or expired: nothing to run
    if f[1] == 'cancelled' and f[2] == entry then finish(id, 'cancelled') end
  elseif f[3] == '1' and go_on(q, entry, id) then
    res[#res + 1] = {'resumed', id}
  elseif f[3] == '1' then
    emit(id, ARGV[12])
    drop(q, entry)
    finish(id, 'failed')
    res[#res + 1] = {'failed', id}
  elseif ARGV[10] == '1' then
    local got = start(q, entry, id, true)
    if got then res[#res + 1] = {'run', unpack(got)} end
  else
    requeue(q, entry, id)
    emit(id, ARGV[13])
    res[#res + 1] = {'requeued', id}
  end
end
return res
"""
)

RENEW = (
    PRELUDE
    + """
-- Extend C's leases. ARGV[8..]: (job id, entry) pairs. Per job: 1 held, 0 lost, 2 cancelled.
local res = {}
for i = 8, #ARGV, 2 do
  local id, entry = ARGV[i], ARGV[i + 1]
  local f = redis.call('HMGET', JP .. id, 'state', 'owner', 'entry', 'queue')
  local code = 0
  if f[2] == C and f[3] == entry then
    if f[1] == 'cancelled' then
      code = 2
    elseif f[1] == 'running' then
      -- XCLAIM to the same consumer resets the entry's idle time: that is the lease
      local got = redis.call('XCLAIM', f[4], G, C, 0, entry, 'JUSTID')
      if #got == 1 then code = 1 end
    end
  end
  res[#res + 1] = code
end
return res
"""
)

PUBLISH = (
    PRELUDE
    + """
-- what the client has of the answer (a Trail event): ids appended, exact flag, head once
local function trail(j, t)
  if #t.k > 0 then
    local ids = redis.call('HGET', j, 'ids')
    local more = table.concat(t.k, ',')
    if ids and ids ~= '' then more = ids .. ',' .. more end
    redis.call('HSET', j, 'ids', more)
  end
  redis.call('HSET', j, 'exact', t.x and '1' or '0')
  if t.h then redis.call('HSET', j, 'head', cjson.encode(t.h)) end
end

-- Append output events of jobs C holds. ARGV[8..]: (job id, seq, kind, payload) quads,
-- kind d(ata) r(esult) x (done) f(ailed), or a(ssigned): the worker C runs the job on (or
-- that it loads the job's model), or t(rail): what the client has, kept in the job's hash;
-- both unnumbered (seq ignored).
-- A seq at or below the job's last one was already written (a re-sent call) and is skipped.
-- A final event ends the job and acks its entry.
-- Per event: 1 written (or already), 0 not C's job any more, 2 cancelled.
local res = {}
for i = 8, #ARGV, 4 do
  local id, seq, kind = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local j = JP .. id
  local f = redis.call('HMGET', j, 'state', 'owner', 'seq', 'queue', 'entry')
  local code = 0
  if f[2] ~= C then
    code = 0
  elseif kind == 'a' then
    if f[1] == 'running' then
      emit(id, ARGV[i + 3])
      code = 1
    elseif f[1] == 'cancelled' then
      code = 2
    end
  elseif kind == 't' then
    if f[1] == 'running' then
      trail(j, cjson.decode(ARGV[i + 3]))
      code = 1
    elseif f[1] == 'cancelled' then
      code = 2
    end
  elseif seq <= tonumber(f[3]) then
    code = 1
  elseif f[1] == 'cancelled' then
    code = 2
  elseif f[1] == 'running' then
    emit(id, ARGV[i + 3])
    redis.call('HSET', j, 'seq', seq)
    if kind == 'd' or kind == 'r' then redis.call('HSET', j, 'started', '1') end
    if kind == 'r' or kind == 'x' then
      drop(f[4], f[5])
      finish(id, 'succeeded')
    elseif kind == 'f' then
      drop(f[4], f[5])
      finish(id, 'failed')
    end
    code = 1
  end
  res[#res + 1] = code
end
return res
"""
)

ACK = (
    PRELUDE
    + """
-- C is done with these jobs. ARGV[8] is the Failed event for a job still running (it ended
-- without a final event); ARGV[9..]: (job id, entry) pairs. Per job: 1 acked, 0 not C's.
local res = {}
for i = 9, #ARGV, 2 do
  local id, entry = ARGV[i], ARGV[i + 1]
  local f = redis.call('HMGET', JP .. id, 'state', 'owner', 'entry', 'queue')
  local code = 0
  if f[2] == C and f[3] == entry then
    drop(f[4], entry)
    if f[1] == 'running' then
      emit(id, ARGV[8])
      finish(id, 'failed')
    elseif f[1] == 'cancelled' then
      finish(id, 'cancelled')
    end
    code = 1
  end
  res[#res + 1] = code
end
return res
"""
)

GIVE_BACK = (
    PRELUDE
    + """
-- C puts a job it holds back in its queue (first in its class). ARGV[8] job id, ARGV[9] entry,
-- ARGV[10] the Requeued event, ARGV[11] the tokens of context it needs from now on, if more
-- than before (its prompt was refused as too long). Returns 1 requeued, 0 not C's job, -1 it
-- already answered.
local id, entry = ARGV[8], ARGV[9]
local f = redis.call('HMGET', JP .. id, 'state', 'owner', 'entry', 'queue', 'started', 'need')
if f[1] ~= 'running' or f[2] ~= C or f[3] ~= entry then return 0 end
if f[5] == '1' then return -1 end
if tonumber(ARGV[11]) > tonumber(f[6] or '0') then
  redis.call('HSET', JP .. id, 'need', ARGV[11])
end
requeue(f[4], entry, id)
emit(id, ARGV[10])
return 1
"""
)

GO_ON = (
    PRELUDE
    + """
-- C puts back a job that answered in part, to go on elsewhere (its worker was lost): first
-- in its class, with what the client has (ARGV[11], the continuation) for the next
-- holder. ARGV[8] job id, ARGV[9] entry, ARGV[10] the Requeued event. Returns 1 put back,
-- 0 not C's job.
local id, entry = ARGV[8], ARGV[9]
local f = redis.call('HMGET', JP .. id, 'state', 'owner', 'entry', 'queue')
if f[1] ~= 'running' or f[2] ~= C or f[3] ~= entry then return 0 end
requeue(f[4], entry, id)
redis.call('HSET', JP .. id, 'resume', ARGV[11])
emit(id, ARGV[10])
return 1
"""
)

ADOPT = (
    PRELUDE
    + """
-- C takes over a running job from a holder that is still answering through C (a worker
-- that reconnected to another router). Output so far stays; the old holder is fenced off.
-- ARGV[8] job id, ARGV[9] the attempt the worker runs (a job run again since is not its).
-- Returns the start fields (with the job's last seq) and its trail (ids, exact, head), or nil.
local id = ARGV[8]
local f = redis.call('HMGET', JP .. id, unpack(FIELDS))
if f[1] ~= 'running' or tonumber(f[4]) ~= tonumber(ARGV[9]) then return nil end
local q, entry = redis.call('HGET', JP .. id, 'queue'), f[2]
if #redis.call('XCLAIM', q, G, C, 0, entry, 'JUSTID') ~= 1 then return nil end
redis.call('HSET', JP .. id, 'owner', C)
local t = redis.call('HMGET', JP .. id, 'ids', 'exact', 'head')
return {id, q, entry, tonumber(f[4]), f[5], f[6], f[7], f[8], f[9], f[11] or '',
        f[12] or '0', t[1] or '', t[2] or '', t[3] or ''}
"""
)

PRUNE = (
    PRELUDE
    + """
-- Delete consumers of KEYS[1]'s group that hold nothing and were given nothing for
-- ARGV[8] ms (mostly processes that went away). Atomic, so no consumer loses entries it
-- was just given; one still alive and blocked in XREADGROUP is recreated by Redis when
-- its next entry comes.
local cs = redis.pcall('XINFO', 'CONSUMERS', KEYS[1], G)
if cs.err then return 0 end
local n = 0
for _, c in ipairs(cs) do
  local info = {}
  for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
  if info['pending'] == 0 and info['idle'] >= tonumber(ARGV[8]) and info['name'] ~= C then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], G, info['name'])
    n = n + 1
  end
end
return n
"""
)
