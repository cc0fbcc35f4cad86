"""Task curation: a file of coding-task rows in, the rows worth training on out.

`python -m harnessrl.curate IN.jsonl OUT.jsonl`: each filter is a named step (clean.py); the
near-duplicate and contamination checks are in dedup.py, pass@k probing with the policy through
the train loop in probe.py. It sits before the loop: its output is what `rollout.tasks=coding:PATH`
reads.
"""
