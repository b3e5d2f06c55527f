"""``dcpkit inspect``: what a checkpoint holds. DCP folders, HF safetensors folders and
``torch.save`` files.

JSON output (``--json``), stable across versions (fields are only ever added)::

    {
      "path": str, "format": "dcp" | "hf-safetensors" | "torch-save",
      "step": int | null, "world_size": int | null,
      "published": bool,          # a step-N folder, as discovery sees it
      "complete": bool,           # structure and file sizes check out (no checksums; see verify)
      "problems": [str],          # what makes it incomplete
      "tensors": [{"name", "group", "dtype", "shape": [int], "bytes", "shards"}],
      "objects": [str],           # non-tensor values (DCP), by key
      "groups": {"model" | "optimizer" | USER STATE | "other": {"tensors": int, "bytes": int}},
      "files": [{"name", "bytes", "rank": int | null}],
      "total_bytes": int          # bytes of all files
    }
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dcpkit.formats.sources import DCP, open_source
from dcpkit.integrity import verify_checkpoint
from dcpkit.layout import NON_MODEL_GROUPS, RANK_FILE, is_model_key, parse_step
from dcpkit.readers import reading
from dcpkit.units import human_bytes


def _group(name: str, groups: frozenset[str]) -> str:
    """``model``, ``optimizer``, a user state's own group (named by the manifest), or ``other``."""
    head = name.split(".", 1)[0]
    if is_model_key(name, groups):
        return "model"
    if head == "optimizer" or (head in groups and head not in NON_MODEL_GROUPS):
        return head
    return "other"


def inspect_path(
    path: str | Path,
    storage_options: dict[str, Any] | None = None,
    trust_pickle: bool = False,
    step: int | str | None = None,
) -> dict[str, Any]:
    """A description of the checkpoint at ``path``, a folder, file or URL, or a checkpoint
    folder with ``step`` (a number or ``latest``) (the JSON schema above). Reads metadata only:
    a remote checkpoint is not downloaded. A step is held against retention meanwhile."""
    with (
        reading(path, step, "inspect", storage_options) as held,
        held.store.view(held.name, data=False) as view,
    ):
        return _describe(held.store, held.name, view.path, view.location, trust_pickle)


def _describe(store: Any, entry: str, p: Path, location: str, trust_pickle: bool) -> dict[str, Any]:
    source = open_source(p, trust_pickle=trust_pickle, bounded=True)
    try:
        tensors = []
        for name in source.names():
            if source.kind == DCP:  # its entry built once (from arrays at scale)
                tmd = source.tensors[name]
                dtype, shape, shards = tmd.properties.dtype, list(tmd.size), len(tmd.chunks)
            else:
                dtype, shape, shards = source.dtype(name), list(source.shape(name)), 1
            n = dtype.itemsize
            for s in shape:
                n *= s
            tensors.append(
                {
                    "name": name,
                    "group": _group(name, getattr(source, "groups", frozenset())),
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": shape,
                    "bytes": n,
                    "shards": shards,
                }
            )
        objects = list(source.objects) if source.kind == DCP else []
        kind = source.kind
    finally:
        source.close()
    del source  # its metadata (GiBs of arrays at scale) before the checks below read it again
    groups: dict[str, dict[str, int]] = {}
    for t in tensors:
        g = groups.setdefault(t["group"], {"tensors": 0, "bytes": 0})
        g["tensors"] += 1
        g["bytes"] += t["bytes"]
    folder = p if p.is_dir() else None
    files = []
    if folder is not None:
        for f in sorted(folder.iterdir()):
            if f.is_file():
                m = RANK_FILE.match(f.name)
                files.append(
                    {
                        "name": f.name,
                        "bytes": f.stat().st_size,
                        "rank": int(m.group(1)) if m else None,
                    }
                )
    else:
        files.append({"name": p.name, "bytes": p.stat().st_size, "rank": None})
    manifest, _ = store.read_manifest(entry) if folder is not None else (None, [])
    step = manifest.get("step") if manifest else None
    if step is None:
        step = parse_step(entry)
    ranks = {f["rank"] for f in files if f["rank"] is not None}
    world = manifest.get("world_size") if manifest else (len(ranks) or None)
    report = verify_checkpoint(store, entry, checksums=False)
    return {
        "path": location,
        "format": kind,
        "step": step,
        "world_size": world,
        "published": report.ok and store.is_published(entry),
        "complete": report.ok,
        "problems": [str(x) for x in report.problems],
        "tensors": tensors,
        "objects": objects,
        "groups": groups,
        "files": files,
        "total_bytes": sum(f["bytes"] for f in files),
    }


def format_inspect(info: dict[str, Any], limit: int | None = 60) -> str:
    """The human-readable report."""
    lines = [f"{info['path']}  ({info['format']})"]
    state = "published" if info["published"] else ("complete" if info["complete"] else "INCOMPLETE")
    lines.append(
        f"  step {info['step'] if info['step'] is not None else '-'}, "
        f"world size {info['world_size'] or '-'}, {state}, "
        f"{human_bytes(info['total_bytes'])} in {len(info['files'])} file(s)"
    )
    for problem in info["problems"]:
        lines.append(f"  problem: {problem}")
    lines.append("  groups:")
    for name, g in info["groups"].items():
        lines.append(f"    {name:<10} {g['tensors']:>6} tensors  {human_bytes(g['bytes']):>10}")
    if info["objects"]:
        lines.append(f"    {'values':<10} {len(info['objects']):>6} non-tensor entries")
    ranks: dict[Any, list[dict]] = {}
    for f in info["files"]:
        ranks.setdefault(f["rank"], []).append(f)
    lines.append("  files:")
    for rank in sorted(ranks, key=lambda r: (r is None, r or 0)):
        label = f"rank {rank}" if rank is not None else "shared"
        for f in ranks[rank]:
            lines.append(f"    {label:<8} {f['name']:<40} {human_bytes(f['bytes']):>10}")
    tensors = info["tensors"]
    shown = tensors if limit is None else tensors[:limit]
    width = max([len(t["name"]) for t in shown] + [4])
    lines.append("  tensors:")
    lines.append(f"    {'name':<{width}}  {'dtype':<9} {'shape':<18} {'bytes':>10} shards")
    for t in shown:
        shape = "x".join(map(str, t["shape"])) or "scalar"
        lines.append(
            f"    {t['name']:<{width}}  {t['dtype']:<9} {shape:<18} "
            f"{human_bytes(t['bytes']):>10} {t['shards']:>6}"
        )
    if len(shown) < len(tensors):
        lines.append(f"    ... {len(tensors) - len(shown)} more (--all shows every tensor)")
    return "\n".join(lines)
