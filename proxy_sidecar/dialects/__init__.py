"""Token-in mode: the Responses and Messages dialects served from the sidecar's own rendering.

The sidecar renders the conversation with the model's chat template, reuses the ids it sampled
earlier in the rollout, and calls the upstream's `/v1/completions` with token-id prompts.
"""
