"""The providers' side: the lean HTTP client (``wire``), the ``Upstream`` seam the call
path sends through, and the built-in simulated provider.
"""
