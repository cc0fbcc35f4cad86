"""The servers and sidecars the train loop drives: serving, weight sync, capture control."""
