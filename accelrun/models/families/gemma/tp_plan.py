"""Gemma's tensor-parallel plan as data. Its blocks use Llama's module names (Llama's attention, a
GeGLU with SwiGLU's w1/w3/w2), so the block plans are Llama's; the ends carry transformers' names."""

from __future__ import annotations

from accelrun.models.families.llama.tp_plan import BLOCK_PLAN, SP_BLOCK_PLAN, ends_plan

__all__ = ["BLOCK_PLAN", "SP_BLOCK_PLAN", "end_plan"]

end_plan = ends_plan("embed_tokens", "lm_head")
