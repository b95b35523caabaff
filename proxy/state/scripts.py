"""The Lua scripts behind the redis backend: every change to shared state is one of them.

Keys, under the configured prefix ``p`` (one Redis, not a cluster: scripts build keys):

- ``p:leases:{provider}``  sorted set, a slot held: member → lease expiry (Redis ms)
- ``p:waiters:{provider}`` sorted set, a call waiting for a slot: member → score (below)
- ``p:wexp:{provider}``    sorted set, waiter liveness: member → expiry (Redis ms)
- ``p:wake:{replica}``     list, members granted a slot while they waited
- ``p:replicas``           sorted set, replica → heartbeat expiry
- ``p:rebuilding``        present for a heartbeat and a half after Redis lost the state: no grants
- ``p:seen:{replica}``     the number of the replica's last heartbeat (what Redis knows of it)
- ``p:limit:{provider}``   a 429's cut of the provider's limit, for ``GROW_EVERY_S``
- ``p:breaker:{deployment}`` present (with a TTL) while the deployment's breaker is open
- ``p:rate:{name}``        hash, an rpm/tpm bucket pair (``r``, ``t``, ``ts``)
- ``p:vclock:{provider}``  hash, each key's virtual clock per rank: ``{rank}|{key}`` → ms
- ``p:bspent:…``, ``p:bheld:…`` the keys' spend budgets (``proxy.state.budgets``)

A member is ``{replica}|{n}|{provider}``. Times come from Redis ``TIME`` only, never a replica's
clock. A waiter's score is ``rank * 2**41 + start``: lower goes first, so a more urgent tier
or level first, then the earliest start. A call's start is its arrival (``now -
waited_ms``: its wait so far is measured on its replica's clock, which is only ever a
difference) plus how far its key's virtual clock in that rank runs ahead of now; each of
the key's calls that has to wait moves the clock on by its claimed milliseconds over the
key's weight (VirtualClock; calls granted at once move nothing, so a key that had the
provider to itself is not made to pay for it later). So a key that sends a burst, from
any replica, queues behind itself, a key that sends now and then starts at its arrival,
and keys that keep calls waiting are served by weight, across every replica; a key's own
calls keep their arrival order. In scores ``now`` counts from 2023-11-14, so 2**41 ms last
until 2093.
"""

from __future__ import annotations

_NOW = """
local EPOCH_MS = 1700000000000  -- arrival in scores counts from 2023: 2^41 ms last 69 years
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""

# Redis lost the replicas' state: no slot is handed out until every live replica has had a
# heartbeat to write back the leases it holds (a heartbeat and a half: replicas beat every
# second, or every third of the TTL).
_REBUILD = """
local function rebuilding(p, ttl)
  redis.call('SET', p .. 'rebuilding', 1, 'PX', math.floor(math.min(1000, ttl / 3) * 1.5), 'NX')
end
"""

# Purge expired leases, then hand free slots to the best live waiters, waking their
# replicas (except ``me``: the caller learns from the script's answer).
_SWEEP = """
local function sweep(p, prov, limit, now, ttl, me)
  if redis.call('EXISTS', p .. 'rebuilding') == 1 then return end
  local lk = p .. 'leases:' .. prov
  local wk = p .. 'waiters:' .. prov
  local ek = p .. 'wexp:' .. prov
  redis.call('ZREMRANGEBYSCORE', lk, '-inf', now)
  local cut = redis.call('GET', p .. 'limit:' .. prov)
  if cut then limit = math.min(limit, tonumber(cut)) end
  local n = redis.call('ZCARD', lk)
  while n < limit do
    local best = redis.call('ZPOPMIN', wk)
    if #best == 0 then break end
    local m = best[1]
    local alive = redis.call('ZSCORE', ek, m)
    redis.call('ZREM', ek, m)
    if alive and tonumber(alive) > now then
      redis.call('ZADD', lk, now + ttl, m)
      n = n + 1
      if m ~= me then
        local wake = p .. 'wake:' .. string.match(m, '^(.-)|')
        redis.call('RPUSH', wake, m)
        redis.call('PEXPIRE', wake, ttl * 3)
      end
    end
  end
end
"""

# Slots asked for and given back since the last call, in one round trip. ARGV: prefix,
# ttl_ms, releases, acquires: each a JSON list (one argument each, so a batch of a hundred
# costs the client one string to send, not eight hundred), a release [provider, member,
# limit], an acquire [provider, member, limit, rank, waited_ms, key, weight, claim_ms].
# Answers one flag per acquire, as one string ("101"; one line for the client to read):
# 1 granted, 0 waiting (its replica is woken through its wake list when a slot is handed
# to it); and the batch's providers that nobody waits for, within their limit. Releasing
# twice, or a member never seen, is harmless; releasing a waiter withdraws it. Releases go
# first, so a slot given back in the same batch is handed to the best waiter, not the
# batch's next.
BATCH = _NOW + _REBUILD + _SWEEP + """
local p, ttl = ARGV[1], tonumber(ARGV[2])
-- every replica beats before it serves: no replicas means Redis lost them
if redis.call('EXISTS', p .. 'replicas') == 0 then rebuilding(p, ttl) end
local swept, gone = {}, {}
for _, release in ipairs(cjson.decode(ARGV[3])) do
  local prov = release[1]
  local members = gone[prov] or {}
  members[#members + 1] = release[2]
  gone[prov], swept[prov] = members, release[3]
end
-- one ZREM per provider and 1000 members (unpack's stack), not one per release
for prov, members in pairs(gone) do
  for i = 1, #members, 1000 do
    local j = math.min(i + 999, #members)
    if redis.call('ZREM', p .. 'leases:' .. prov, unpack(members, i, j)) <= j - i then
      -- not all were leases: waiters withdrawn (or a member released twice)
      redis.call('ZREM', p .. 'waiters:' .. prov, unpack(members, i, j))
      redis.call('ZREM', p .. 'wexp:' .. prov, unpack(members, i, j))
    end
  end
end
for prov, limit in pairs(swept) do
  sweep(p, prov, limit, now, ttl, '')
end
-- Free slots of a provider nobody waits for (0 once someone may): a call granted one
-- takes it at once, without joining the waiters to be popped straight back.
local frozen = redis.call('EXISTS', p .. 'rebuilding') == 1
local room = {}
local function free(prov, limit)
  if room[prov] == nil then
    local lk = p .. 'leases:' .. prov
    redis.call('ZREMRANGEBYSCORE', lk, '-inf', now)
    local cut = redis.call('GET', p .. 'limit:' .. prov)
    if cut then limit = math.min(limit, tonumber(cut)) end
    room[prov] = limit - redis.call('ZCARD', lk)
    if frozen or redis.call('EXISTS', p .. 'waiters:' .. prov) == 1 then room[prov] = 0 end
  end
  return room[prov]
end
-- Slots granted from the room are written in one ZADD NX per provider (and 1000 members),
-- before that provider's next waiter and at the end; a member that held its slot already
-- keeps it and gives its share of the room back.
local taken = {}
local function take(prov)
  local members = taken[prov]
  taken[prov] = nil
  for i = 1, #members, 1000 do
    local args = {}
    for j = i, math.min(i + 999, #members) do
      args[#args + 1] = now + ttl
      args[#args + 1] = members[j]
    end
    local added = redis.call('ZADD', p .. 'leases:' .. prov, 'NX', unpack(args))
    room[prov] = room[prov] + #args / 2 - added
  end
end
local granted = {}
local asks = cjson.decode(ARGV[4])
for _, ask in ipairs(asks) do
  local prov, member, limit = ask[1], ask[2], ask[3]
  local lk = p .. 'leases:' .. prov
  local left = free(prov, limit)
  if left <= 0 and taken[prov] then
    take(prov)
    left = room[prov]
  end
  local flag = 1
  if left > 0 then
    local members = taken[prov] or {}
    members[#members + 1] = member
    taken[prov], room[prov] = members, left - 1
  elseif not redis.call('ZSCORE', lk, member) then
    room[prov] = 0
    local rank, base = ask[4], now - EPOCH_MS
    local vk, field = p .. 'vclock:' .. prov, string.format('%d|%s', rank, ask[6])
    local lead = tonumber(redis.call('HGET', vk, field) or '0') - base
    if lead < 0 then lead = 0 end
    local start = base - ask[5] + lead
    local score = rank * 2199023255552 + start
    redis.call('ZADD', p .. 'waiters:' .. prov, score, member)
    redis.call('ZADD', p .. 'wexp:' .. prov, now + ttl, member)
    sweep(p, prov, limit, now, ttl, member)
    if not redis.call('ZSCORE', lk, member) then  -- it waits: its key's clock moves on
      redis.call('HSET', vk, field, base + lead + ask[8] / ask[7])
      redis.call('PEXPIRE', vk, 86400000)
      flag = 0
    end
  end
  granted[#granted + 1] = flag
end
for prov in pairs(taken) do take(prov) end
-- The providers of this batch nobody waits for, their leases within the lowest limit the
-- batch gave them: the replica may hand a lease it gives back to its next call (batcher).
local lowest, clear = {}, {}
for prov, limit in pairs(swept) do lowest[prov] = limit end
for _, ask in ipairs(asks) do lowest[ask[1]] = math.min(ask[3], lowest[ask[1]] or ask[3]) end
if not frozen then
  for prov, limit in pairs(lowest) do
    local cut = redis.call('GET', p .. 'limit:' .. prov)
    if cut then limit = math.min(limit, tonumber(cut)) end
    if redis.call('EXISTS', p .. 'waiters:' .. prov) == 0
        and redis.call('ZCARD', p .. 'leases:' .. prov) <= limit then
      clear[#clear + 1] = prov
    end
  end
end
return {table.concat(granted), clear}
"""

# One replica's heartbeat and safety sweep. ARGV: prefix, replica, ttl_ms, recreate (1:
# every held lease is written even if missing, after this replica could not reach Redis),
# beat (this heartbeat's number), last (the number of the last one Redis answered), then
# counted lists: providers (name, limit), held (provider, member, write: 1 for a lease
# Redis has not seen yet, written even if missing; 0: refreshed only if still there, so a
# lease released meanwhile is not brought back), waiting (provider, member), deployments.
# The replica's ``seen`` key holds the number of its last heartbeat: missing, or older
# than ``last``, means Redis lost what the replica told it (an empty restart, a flush, a
# failover to a copy with older data): every held lease is written back and any other
# lease in this replica's name dropped (the older copy's calls ended since). Answers
# {replicas alive, granted waiters, lost waiters, open breakers (deployment, ms left)…,
# forgot (1: Redis had lost this replica)}.
HEARTBEAT = _NOW + _REBUILD + _SWEEP + """
local p, replica, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local recreate = ARGV[4] == '1'
local seen = p .. 'seen:' .. replica
local stored = tonumber(redis.call('GET', seen) or '-1')
local forgot = 0
if stored < tonumber(ARGV[6]) then
  forgot, recreate = 1, true
  rebuilding(p, ttl)
end
redis.call('SET', seen, ARGV[5], 'PX', ttl * 3)
redis.call('ZADD', p .. 'replicas', now + ttl, replica)
redis.call('ZREMRANGEBYSCORE', p .. 'replicas', '-inf', now)
local alive = redis.call('ZCARD', p .. 'replicas')
local i = 7
local limits = {}
for _ = 1, tonumber(ARGV[i]) do
  limits[#limits + 1] = {ARGV[i + 1], tonumber(ARGV[i + 2])}
  i = i + 2
end
i = i + 1
local mine = {}
for _ = 1, tonumber(ARGV[i]) do
  local lk = p .. 'leases:' .. ARGV[i + 1]
  mine[ARGV[i + 2]] = true
  if recreate or ARGV[i + 3] == '1' then
    redis.call('ZADD', lk, now + ttl, ARGV[i + 2])
  else
    redis.call('ZADD', lk, 'XX', now + ttl, ARGV[i + 2])
  end
  i = i + 3
end
if forgot == 1 then
  local own = replica .. '|'
  for _, entry in ipairs(limits) do
    local lk = p .. 'leases:' .. entry[1]
    for _, m in ipairs(redis.call('ZRANGE', lk, 0, -1)) do
      if string.sub(m, 1, #own) == own and not mine[m] then redis.call('ZREM', lk, m) end
    end
  end
end
i = i + 1
local granted, lost = {}, {}
for _ = 1, tonumber(ARGV[i]) do
  local prov, m = ARGV[i + 1], ARGV[i + 2]
  if redis.call('ZSCORE', p .. 'leases:' .. prov, m) then
    granted[#granted + 1] = m
  elseif redis.call('ZSCORE', p .. 'waiters:' .. prov, m) then
    redis.call('ZADD', p .. 'wexp:' .. prov, now + ttl, m)
  else
    lost[#lost + 1] = m
  end
  i = i + 2
end
i = i + 1
local open = {}
for _ = 1, tonumber(ARGV[i]) do
  local left = redis.call('PTTL', p .. 'breaker:' .. ARGV[i + 1])
  if left > 0 then
    open[#open + 1] = ARGV[i + 1]
    open[#open + 1] = left
  end
  i = i + 1
end
for _, entry in ipairs(limits) do
  sweep(p, entry[1], entry[2], now, ttl, '')
end
return {alive, granted, lost, open, forgot}
"""

# ARGV: prefix, name, rpm (0: none), tpm (0: none), requests, tokens, take (1) or adjust
# (0). Take: both buckets have room → take them, answer 0; else take nothing and answer
# the ms to wait. Adjust: give back (negative amounts charge), answer 0. A request larger
# than a whole bucket goes once it is full (leaving debt), as ``core.health.limits.TokenBucket``.
RATE = _NOW + """
local key = ARGV[1] .. 'rate:' .. ARGV[2]
local rpm, tpm = tonumber(ARGV[3]), tonumber(ARGV[4])
local requests, tokens = tonumber(ARGV[5]), tonumber(ARGV[6])
local state = redis.call('HMGET', key, 'r', 't', 'ts')
local r = tonumber(state[1]) or rpm
local t = tonumber(state[2]) or tpm
local elapsed = math.max(0, now - (tonumber(state[3]) or now))
r = math.min(rpm, r + elapsed * rpm / 60000)
t = math.min(tpm, t + elapsed * tpm / 60000)
local wait = 0
if ARGV[7] == '1' then
  if rpm > 0 and r < math.min(requests, rpm) then
    wait = math.max(wait, (math.min(requests, rpm) - r) * 60000 / rpm)
  end
  if tpm > 0 and t < math.min(tokens, tpm) then
    wait = math.max(wait, (math.min(tokens, tpm) - t) * 60000 / tpm)
  end
  if wait == 0 then
    r = math.max(-rpm, r - requests)
    t = math.max(-tpm, t - tokens)
  end
else
  r = math.min(rpm, math.max(-rpm, r + requests))
  t = math.min(tpm, math.max(-tpm, t + tokens))
end
redis.call('HSET', key, 'r', tostring(r), 't', tostring(t), 'ts', now)
redis.call('PEXPIRE', key, 120000)
return math.ceil(wait)
"""

# ARGV: prefix, provider, limit, ttl_ms: lower the provider's shared limit (never raise
# it) for ttl_ms.
CUT = """
local key = ARGV[1] .. 'limit:' .. ARGV[2]
local current = redis.call('GET', key)
if not current or tonumber(current) > tonumber(ARGV[3]) then
  redis.call('SET', key, ARGV[3], 'PX', ARGV[4])
end
return 0
"""
