"""Incremental token-in prompts: rendered text cut where tokenizing cannot cross, and the ids of
each cut segment kept per rollout, so a call whose history only grows tokenizes only its new text.
"""
