"""Scheduling inside one backend: the pure scheduler (queues, admission, KV accounting, the batch
plan, finish rules, preemption) over its sequences, the KV layout (unified / split) and the cache
switch (on / the null cache) as strategies, its adaptive concurrency limit and its prefix cache."""
