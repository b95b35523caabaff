"""The plumbing every room of the driver stands on: the HTTP edge (what comes in from a
client, which upstream headers go out), the typed app and request keys, the lifecycle
(drain), and the sinks calls report to (metrics, access log, the dashboard's history).
"""
