"""Run reports: environment, peak FLOP/s, per-step metrics, memory, summaries, run directories, and
comparisons between runs.

Modules, in the order a run uses them: ``rundir`` (where a run writes), ``env`` (what it ran on),
``peak`` + ``gpu_table`` (the peak MFU divides by), ``memory`` and ``metrics`` (each step),
``profiler`` (``report.profile_steps``: a Chrome trace of chosen steps), ``summary`` + ``markdown`` +
``html`` + ``plots`` (report.json, report.md, report.html), ``files`` (atomic writes), ``fmt``
(numbers as text).

After runs: ``rundata`` (a run directory read back), ``stats`` (bootstrap intervals on a ratio of
medians), ``parity`` (do two loss curves agree), ``compare`` + ``compare_render`` (runs side by side),
``ab`` (variants as fresh interleaved processes, with a verdict), ``runs_index`` (``accelrun runs list``).
Importing this package does not import torch; the functions that need it import it when called.
"""
