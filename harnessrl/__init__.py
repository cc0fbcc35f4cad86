"""harnessrl: RL for LLM agents through their unchanged harness."""

__version__ = "0.1.0"
