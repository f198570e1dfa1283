"""The chaos suite: real digits training jobs with faults injected while they train.

``scenarios`` holds one function per fault scenario (each runs one trial and returns a ``TrialResult``),
``run`` the ``make chaos`` runner that repeats them and writes ``docs/reliability.md``; tests/test_chaos.py
runs every scenario once inside ``make test``.
"""
