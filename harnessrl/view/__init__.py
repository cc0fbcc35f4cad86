"""The trace viewer: `python -m harnessrl.view STORE_URL [--runs OUT_DIR]` serves a store's
rollouts, calls, merged sequences, groups and a run's training curves as web pages, read-only."""
