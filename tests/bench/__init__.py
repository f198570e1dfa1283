"""Benchmarks of edl-argo: RecordIO reads, task dispatch and training throughput.

Run them all with ``python -m tests.bench.run --output docs/benchmarks.md`` (``make bench``); see
:mod:`tests.bench.run` for the options. Every figure is reported together with a baseline measured in the
same run, as a ratio, with the spread over repeats: the machines these run on are small and shared.
"""
