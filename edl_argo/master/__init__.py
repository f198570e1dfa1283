"""The master: dispatches data shards to workers and keeps the job's bookkeeping."""
