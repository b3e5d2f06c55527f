"""The figures blocks of local reads and writes (``benchmarks/io_speed.py``) and of recovery
from each tier (``benchmarks/recovery.py``), rendered from their results files."""

from __future__ import annotations

from _format import GIB, head, para, percent, spread, times

IO_ROWS = [
    ("sync save (vs raw write + fsync)", "save_s", "raw_write_fsync_s"),
    ("sync save, a run's first", "first_save_s", "raw_write_fsync_s"),
    ("load, page cache warm (vs raw parallel read)", "load_warm_s", "raw_read_warm_s"),
    ("load + verify, warm", "load_verify_warm_s", "raw_read_warm_s"),
    ("load, page cache dropped", "load_cold_s", "raw_read_cold_s"),
    ("load + verify, dropped", "load_verify_cold_s", "raw_read_cold_s"),
    ("PyTorch `dcp.load` + `set_state_dict`, warm", "torch_load_warm_s", "raw_read_warm_s"),
    ("PyTorch `dcp.load` + `set_state_dict`, dropped", "torch_load_cold_s", "raw_read_cold_s"),
]
GOALS = [  # what the IO work aims at against raw IO of the same bytes, at >= 4 GiB
    ("the sync save", "save_s", "raw_write_fsync_s", 0.9),
    ("the warm load", "load_warm_s", "raw_read_warm_s", 0.8),
    ("the cold load", "load_cold_s", "raw_read_cold_s", 0.8),
]


def _x(run: dict, key: str, base: str) -> float:
    """dcpkit's speed over the baseline's: the baseline's time over dcpkit's."""
    return run["slowest"][base] / run["slowest"][key]


def _verify(run: dict, temp: str) -> float:
    s = run["slowest"]
    return s[f"load_verify_{temp}_s"] / s[f"load_{temp}_s"] - 1


def _hash_floor(run: dict) -> float:
    """What hashing every byte adds to a warm raw read: the least any verification costs."""
    s = run["slowest"]
    return s["raw_read_hashed_warm_s"] / s["raw_read_warm_s"] - 1


def io_speed(data: dict, goals: bool = True) -> str:
    runs = data["runs"]
    lines = head(
        "x raw, same run",
        *(f"{r['checkpoint_bytes'] / GIB:.2f} GiB, {r['nproc']} rank{'s' * (r['nproc'] > 1)}"
          for r in runs),
    )  # fmt: skip
    row = lambda name, cells: lines.append(f"| {name} | {' | '.join(cells)} |")  # noqa: E731
    for name, key, base in IO_ROWS:
        row(name, [f"{_x(r, key, base):.2f}" for r in runs])
    row(
        "verify-on-load, warm / dropped",
        [f"{percent(_verify(r, 'warm'))} / {percent(_verify(r, 'cold'))}" for r in runs],
    )
    hashed = [_hash_floor(r) for r in runs]
    row("floor: raw read hashing every byte, warm", [percent(h) for h in hashed])
    row(
        "floor: DCP's own steps, no bytes (s)",
        [f"{r['slowest']['dcp_floor_warm_s']:.3f}" for r in runs],
    )
    row(
        "sync save / load warm / load dropped (s)",
        [
            f"{r['slowest']['save_s']:.2f} / {r['slowest']['load_warm_s']:.3f} / "
            f"{r['slowest']['load_cold_s']:.2f}"
            for r in runs
        ],
    )
    gibps = lambda r, k: f"{r['checkpoint_bytes'] / GIB / r['slowest'][k]:.1f}"  # noqa: E731
    row(
        "raw: write + fsync / warm read / cold read (GiB/s)",
        [
            " / ".join(
                gibps(r, k) for k in ("raw_write_fsync_s", "raw_read_warm_s", "raw_read_cold_s")
            )
            for r in runs
        ],
    )
    return "\n".join(lines) + "\n" + _io_summary(data, goals)


def io_speed_small(data: dict) -> str:
    """The run of many small tensors: its table and summary; the goals are the large ones'."""
    return io_speed(data, goals=False)


def _io_summary(data: dict, goals: bool) -> str:
    """What the run says, in ranges over its columns; the goals at its largest size."""
    runs = data["runs"]

    def over(key: str, base: str) -> str:
        return spread([_x(r, key, base) for r in runs], "{:.2f}".format) + "x"

    cpu = [r["cpu"] for r in runs]
    hashed = [_hash_floor(r) for r in runs]
    share = spread([c["xxh3_only_cpu"] / c["load_warm_cpu"] for c in cpu], percent)
    text = (
        f"Medians of {data['reps']}, slowest rank. Cold loads ran at "
        f"{over('load_cold_s', 'raw_read_cold_s')} the raw read, warm loads at "
        f"{over('load_warm_s', 'raw_read_warm_s')}; sync saves at "
        f"{over('save_s', 'raw_write_fsync_s')} the raw write, a run's first save at "
        f"{over('first_save_s', 'raw_write_fsync_s')}. Verification cost "
        f"{spread([_verify(r, 'warm') for r in runs], percent)} warm and "
        f"{spread([_verify(r, 'cold') for r in runs], percent)} cold, beside a raw read hashing "
        f"every byte at {spread(hashed, percent)} over a plain one; xxh3-64 alone over the "
        f"same bytes takes {share.replace('+', '')} of a warm load's CPU, and the least "
        "verification can cost a warm load here (the hash's CPU beyond the cores' idle time) is "
        f"{spread([r['verify_floor'] for r in runs], percent)}."
    )
    largest = max(r["gb"] for r in runs)
    if goals and largest >= 4:
        met, missed = [], []
        at = [r for r in runs if r["gb"] == largest]
        for r in at:
            where = f"{r['nproc']} rank{'s' * (r['nproc'] > 1)}"
            for name, key, base, goal in GOALS:
                x = _x(r, key, base)
                (met if x >= goal else missed).append(f"{name} at {where} ({x:.2f}, goal {goal})")
            v = _verify(r, "warm")
            (met if v <= 0.10 else missed).append(
                f"verify-on-load warm at {where} ({percent(v)}, goal +10%)"
            )
        gib = at[0]["checkpoint_bytes"] / GIB
        text += f" At {gib:.2f} GiB the run meets the goal of {', '.join(met) or 'nothing'}"
        text += f"; it misses that of {', '.join(missed)}." if missed else "."
    return "\n" + para(text)


RECOVERY_ROWS = [
    ("memory tier (`/dev/shm`, peer replicas)", "memory_load_s", "memory_step"),
    ("durable, local disk, page cache warm", "disk_warm_load_s", "disk_step"),
    ("durable, local disk, page cache dropped (`posix_fadvise`)", "disk_cold_load_s", "disk_step"),
    ("durable, S3 (SeaweedFS on loopback)", "s3_load_s", "disk_step"),
]


def recovery(data: dict) -> str:
    slowest, gib, first = data["slowest"], data["gib"], data["ranks"][0]
    lines = [
        f"One run, {gib:.2f} GiB of model + AdamW state FSDP-sharded over {data['nproc']} ranks "
        "(slowest rank):",
        "",
        *head("restore from", "step", "seconds", "GiB/s", "x memory tier"),
    ]
    mem = slowest["memory_load_s"]
    for label, key, step in RECOVERY_ROWS:
        if key in slowest:
            s = slowest[key]
            lines.append(
                f"| {label} | {first[step]} | {s:.2f} | {gib / s:.2f} | {times(s / mem)} |"
            )
    stall, floor = slowest["memory_save_stall_s"], slowest["copy_floor_s"]
    text = (
        f"A memory-tier save blocked {stall:.3f} s (median of saves 2-5) against a copy floor of "
        f"{floor:.3f} s ({stall / floor:.2f}x); a durable synchronous save of the same state took "
        f"{slowest['durable_save_s']:.2f} s."
    )
    return "\n".join(lines) + "\n\n" + para(text)
