"""Wire formats: what a client's request body must be, the Batch API's shapes, and Chat
Completions and Anthropic Messages translated both ways (answers through neutral events).
"""
