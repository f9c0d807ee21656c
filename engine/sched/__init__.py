"""Scheduling inside one backend: the pure scheduler (queues, admission, KV accounting, the batch
plan, finish rules, preemption), its adaptive concurrency limit and its prefix cache."""
