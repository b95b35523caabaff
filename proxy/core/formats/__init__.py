"""Wire formats: what a client's request body must be, and the Batch API's shapes.
"""
