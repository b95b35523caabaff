"""The composition root: the app wired from every room (``app``), serving it for real
(``server``: uvloop, signals, drain) through the fast lane where it can (``proxy.http.lane``),
and ``--workers`` (``workers``).
"""
