"""accelrun's graph compiler: capture (Dynamo + AOTAutograd), passes, fusion regions, executors.

Knows nothing of training: it compiles modules and functions. See docs/layout.md and DESIGN.md.
"""
