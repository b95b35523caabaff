"""The fast lane, in a room of its own that only the server imports: requests taken off the
socket with no aiohttp request object (``front``, ``head``, ``request``), answered by an SSE
writer of its own (``events``), where the aiohttp it runs on has the private parts it reads
(``check``); and requests aiohttp refuses itself, answered in OpenAI's error shape
(``refusals``).
"""
