"""The aiohttp driver, in rooms by concern that stack: ``server`` on top imports any room
below it; ``ops``, ``work``, ``call``, ``upstream`` and ``base`` each import only the rooms
below them (``tests/test_layout.py`` checks it; ``docs/architecture.md`` maps them)."""
