"""Token-in prompts: conversations as chat templates take them, and their rendered text tokenized
incrementally (cut where tokenizing cannot cross, each segment's ids kept per rollout), so a call
whose history only grows tokenizes only its new text.
"""
