"""Parallelism and launching: the device mesh, FSDP2, tensor parallelism, and starting ranks
through torchrun's elastic agent."""
