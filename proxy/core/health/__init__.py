"""Provider health: circuit breakers, rate limits and what each provider is known to bear.
"""
