"""The composition root: the app wired from every room (``app``), serving it for real
(``server``: uvloop, signals, drain), ``--workers`` (``workers``), and the fast lane
(``front``, ``head``, ``lane_request``, ``lane_events``, checked by ``lanecheck``).
"""
