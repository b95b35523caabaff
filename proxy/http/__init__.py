"""The aiohttp driver: the server, the request path and the upstream calls."""
