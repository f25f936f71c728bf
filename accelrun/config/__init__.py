"""Recipes: schema, composition (extends + overrides), validation, provenance, search path.

This package must not import torch: ``accelrun validate`` and planners use it on their own.
"""

from accelrun.config.compose import Source
from accelrun.config.errors import ConfigError
from accelrun.config.resolve import ResolvedConfig, load_config
from accelrun.config.schema import RunConfig
from accelrun.config.search import list_recipes, search_path

__all__ = ["ConfigError", "ResolvedConfig", "RunConfig", "Source", "list_recipes", "load_config", "search_path"]
