"""A call's life: classification, estimates, routing, the plan, the attempts that carry it
out (events in, commands out), retries, spend budgets, leases across replicas.
"""
