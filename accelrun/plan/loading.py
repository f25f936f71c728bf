"""Load a recipe for planning: compose it, put in the cluster given on the command line, override.

``--cluster NAME_OR_FILE`` replaces the recipe's ``cluster`` section (it is not merged into it: one
machine's figures must not leak into another's), all but a node count the recipe set apart from its
cluster description, which is the job's. NAME is looked up as ``cluster/NAME`` on
the recipe search path; a file must hold a ``cluster:`` mapping and nothing else. Command-line
overrides apply last, so ``cluster.nodes=16`` adjusts the cluster that was given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from accelrun.config import ConfigError, ResolvedConfig
from accelrun.config.compose import Composed, apply_override, compose_file, merge_into
from accelrun.config.resolve import resolve_config_path
from accelrun.config.search import find_recipe, looks_like_path, search_path
from accelrun.config.validate import config_warnings, validate


@dataclass
class PlanInput:
    resolved: ResolvedConfig
    composed: Composed  # after overrides: the base the layout search builds candidates from


def load_plan_config(
    ref: str | Path, overrides: Sequence[str] = (), cluster: str | None = None,
    search_dirs: list[Path] | None = None,
) -> PlanInput:
    dirs = search_path() if search_dirs is None else search_dirs
    composed = compose_file(resolve_config_path(ref, dirs), dirs)
    if cluster is not None:
        replace_cluster(composed, find_cluster_file(cluster, dirs), dirs)
    for text in overrides:
        apply_override(composed, text)
    cfg = validate(composed.data, composed.sources, composed.duplicate_keys)
    resolved = ResolvedConfig(cfg, composed.sources, composed.files, list(overrides),
                              config_warnings(cfg, composed.sources))
    return PlanInput(resolved, composed)


def find_cluster_file(ref: str, dirs: list[Path]) -> Path:
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    if looks_like_path(ref) or path.suffix:
        raise ConfigError(f"--cluster {ref}: file not found")
    name = ref if ref.startswith("cluster/") else f"cluster/{ref}"
    try:
        return find_recipe(name, dirs)
    except ConfigError as e:
        raise ConfigError(f"--cluster {ref}: {e.messages[0]}") from None


def replace_cluster(dst: Composed, path: Path, dirs: list[Path]) -> None:
    src = compose_file(path.resolve(), dirs)
    extra = sorted(k for k in src.data if k != "cluster")
    if "cluster" not in src.data or not isinstance(src.data["cluster"], dict) or extra:
        what = f"it also sets {', '.join(extra)}" if extra else "it has no `cluster:` mapping"
        raise ConfigError(f"{path}: a cluster description holds one `cluster:` section; {what}")
    # A node count the recipe set apart from its cluster description (configs/llama3-70b-h100.yaml's 4
    # nodes of cluster/h100-8x) is the job's, not the hardware's: it stays with the new description.
    old = dst.data.get("cluster") if isinstance(dst.data.get("cluster"), dict) else {}
    nodes_source = dst.sources.get(("cluster", "nodes"))
    keep_nodes = "nodes" in old and nodes_source is not None and (
        nodes_source.file is None or nodes_source.file != getattr(dst.sources.get(("cluster", "device")), "file", None))
    dst.data.pop("cluster", None)
    for key in [k for k in dst.sources if k[:1] == ("cluster",)]:
        del dst.sources[key]
    merge_into(dst, {"cluster": src.data["cluster"]}, src.sources)
    dst.duplicate_keys += [m for m in src.duplicate_keys if m not in dst.duplicate_keys]
    if keep_nodes:
        merge_into(dst, {"cluster": {"nodes": old["nodes"]}}, {("cluster", "nodes"): nodes_source})
    dst.files += [f for f in src.files if f not in dst.files]

