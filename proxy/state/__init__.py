"""What replicas share: nothing (``memory``, one process) or Redis (``redis``)."""
