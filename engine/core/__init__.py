"""The values every part of the engine shares: requests and their handles, snapshots, events,
errors, streamed text, metrics. Pure. (The `Engine` facade over them is engine/engine.py.)"""
