"""The HTTP edge every server shares: the bounded listener, request body budgets, ASGI types."""
