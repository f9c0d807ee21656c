"""Simulation: workloads, arrivals, the discrete-event simulator over the real router and
schedulers, a run's pure metrics, the study's worked example. (engine/experiment.py runs a
workload through a loaded `Engine`.)"""
