"""accelrun's own code generation for fusion regions.

``values`` turns a region's ATen graph into index-addressable values, ``loop_ir`` schedules them
into kernels (loops over rows with per-row reductions), and ``cpp`` / ``triton`` print and build
those kernels. The executors in ``compile/executors/{cpp,triton}.py`` plug them into the lowering.
"""
