"""Run reports: environment, peak FLOP/s, per-step metrics, memory, summaries and run directories.

Modules, in the order a run uses them: ``rundir`` (where a run writes), ``env`` (what it ran on),
``peak`` + ``gpu_table`` (the peak MFU divides by), ``memory`` and ``metrics`` (each step),
``summary`` + ``markdown`` (report.json, report.md), ``files`` (atomic writes).
Importing this package does not import torch; the functions that need it import it when called.
"""
