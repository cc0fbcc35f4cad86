"""Coding-agent tasks: SWE-style task rows, the shipped offline task set, sandboxes and grading.

In: task rows or folders and an agent's working tree. Out: fresh sandboxes to run a harness in and
a `Grade` computed from the diff alone, in a sandbox of its own.
"""
