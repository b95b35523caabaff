"""Caching: which calls may be answered from the past, and what of them must match.
"""
