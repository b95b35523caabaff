"""The Lua scripts of the Redis store of work that can wait (``proxy.store.redis_store``):
each change to a line's state is one of them, so a line is answered once."""

from __future__ import annotations

# Lines are taken and answered only by the runner holding the lease (KEYS[7] / KEYS[6],
# ARGV[2] / ARGV[4]: a runner that stalled past its lease cannot touch them any more).
TAKE = """
if redis.call('GET', KEYS[7]) ~= ARGV[2] then return {} end
local popped = redis.call('ZPOPMIN', KEYS[1], ARGV[1])
local out = {}
for i = 1, #popped, 2 do
  local idx = popped[i]
  redis.call('HSET', KEYS[2], idx, 'running')
  redis.call('SADD', KEYS[3], idx)
  redis.call('HINCRBY', KEYS[4], 'pending', -1)
  redis.call('HINCRBY', KEYS[4], 'running', 1)
  out[#out + 1] = idx
  out[#out + 1] = redis.call('HGET', KEYS[5], idx) or ''
  out[#out + 1] = redis.call('HGET', KEYS[6], idx) or ''
end
return out
"""
# KEYS: running, status, result, body, counts, runner. ARGV: index, status, result, holder.
FINISH = """
if redis.call('GET', KEYS[6]) ~= ARGV[4] then return 0 end
if redis.call('SREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HINCRBY', KEYS[5], 'running', -1)
redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
return 1
"""
# KEYS: running, pending, status, counts: every running line back to pending.
RECOVER = """
local running = redis.call('SMEMBERS', KEYS[1])
for _, idx in ipairs(running) do
  redis.call('ZADD', KEYS[2], tonumber(idx), idx)
  redis.call('HSET', KEYS[3], idx, 'pending')
end
if #running > 0 then
  redis.call('DEL', KEYS[1])
  redis.call('HINCRBY', KEYS[4], 'running', 0 - #running)
  redis.call('HINCRBY', KEYS[4], 'pending', #running)
end
return #running
"""
# KEYS: pending, running, status, result, body, counts. ARGV: status, then (index, result)
# pairs: each line still pending or running ends as ``status`` with its result; counts
# follow the status each really had.
END = """
local ended = 0
for i = 2, #ARGV, 2 do
  local idx = ARGV[i]
  local was = redis.call('HGET', KEYS[3], idx)
  if was == 'pending' or was == 'running' then
    redis.call('ZREM', KEYS[1], idx)
    redis.call('SREM', KEYS[2], idx)
    redis.call('HSET', KEYS[3], idx, ARGV[1])
    redis.call('HSET', KEYS[4], idx, ARGV[i + 1])
    redis.call('HDEL', KEYS[5], idx)
    redis.call('HINCRBY', KEYS[6], was, -1)
    redis.call('HINCRBY', KEYS[6], ARGV[1], 1)
    ended = ended + 1
  end
end
return ended
"""
# KEYS: batch hash, active. ARGV: doc, id, created_at. In progress → cancelling, or nothing.
CANCEL = """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'cancelling', 'doc', ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
return 1
"""
# KEYS: file hash, data, files of owner, files, bytes. ARGV: id. Counted once, however
# many replicas delete it.
FORGET_FILE = """
local size = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
redis.call('UNLINK', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('DECRBY', KEYS[5], size)
return 1
"""
HOLD = """
local holder = redis.call('GET', KEYS[1])
if not holder or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# KEYS: resp hash. ARGV: status, doc, then the statuses it may move from (none: any).
SET_RESPONSE = """
if #ARGV > 2 then
  local now = redis.call('HGET', KEYS[1], 'status')
  local ok = false
  for i = 3, #ARGV do if now == ARGV[i] then ok = true end end
  if not ok then return 0 end
elseif redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'result', ARGV[2])
return 1
"""
