"""Operating the proxy: ``/admin/*`` (status, reload, events), the dashboard page and its
script (``dashboard.js``), and config reload.
"""
