"""Scheduling: which waiting call gets the next free slot of a provider — the scheduler,
its queues and tickets, the policy (floors, headroom, keys' shares), providers' capacity,
and what a new call foresees of its wait.
"""
