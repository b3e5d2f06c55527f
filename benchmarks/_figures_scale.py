"""The figures blocks of Scale (docs/scale.md), rendered from the results files of
``benchmarks/planning_scale.py``: one run gives every planning table, the verify cells their own.

A run's rows are (model, world size) cells; a cell it could not run on this machine is
extrapolated from the measured ones of the same model and marked ``*`` wherever it is shown."""

from __future__ import annotations

import itertools

from _format import GIB, MIB, head, millions, para, seconds, seconds_span, size, size3, span

STAR = " *"


def _rows(data: dict, model: str) -> list[dict]:
    return sorted((r for r in data["rows"] if r["model"] == model), key=lambda r: r["world"])


def _models(data: dict) -> list[str]:
    return list(dict.fromkeys(r["model"] for r in data["rows"]))


def _shown(data: dict, model: str, smallest: int = 0) -> list[dict]:
    """A model's rows to show: its first measured at ``smallest`` ranks or more, its largest
    measured, and its largest (extrapolated where not measured)."""
    rows = [r for r in _rows(data, model) if "global_plan_s" in r]
    measured = [r for r in rows if r["measured"]]
    first = next((r for r in measured if r["world"] >= smallest), measured[0])
    picked = [first, measured[-1], rows[-1]]
    return [r for i, r in enumerate(picked) if r not in picked[:i]]


def _star(r: dict) -> str:
    return "" if r["measured"] else STAR


def _growth(data: dict, key: str) -> str:
    """Each model's exponent; "-" for one measured at fewer than two sizes (nothing to fit)."""
    fits = [data["growth"].get(m, {}).get(key) for m in _models(data)]
    return " / ".join("-" if g is None else f"{g:.2f}" for g in fits)


def _names(data: dict) -> str:
    return " / ".join(_models(data))


def planning(data: dict) -> str:
    lines = head(
        "model, ranks", "write items", "global planning (DCP's own planner)", "`.metadata`",
        "plans gathered", "coordinator's peak", "second save",
    )  # fmt: skip
    for m in _models(data):
        for r in _shown(data, m):
            dcp = r.get("dcp_global_plan_s")
            plan = seconds(r["global_plan_s"]) + (f" ({seconds(dcp)})" if dcp else "")
            second = (
                f"{r['global_plans'] - 1} plannings, {r['cached_global_plan_s']:.4f} s"
                if r["measured"]
                else ""
            )
            lines.append(
                f"| {m}, {r['world']}{_star(r)} | {millions(r['items'])} | {plan} "
                f"| {size3(r['metadata_bytes'])} | {size3(r['gathered_bytes'])} "
                f"| {size3(r['peak_bytes'])} | {second} |"
            )
    text = (
        f"Growth exponents (log-log fit from 32 ranks on; 1.0 is linear), {_names(data)}: "
        f"planning {_growth(data, 'global_plan_s')}, `.metadata` "
        f"{_growth(data, 'metadata_bytes')}, peak memory {_growth(data, 'peak_bytes')}."
    )
    for m in _models(data):  # DCP's own planner, where the run timed it beside
        timed = [r for r in _rows(data, m) if r.get("dcp_global_plan_s") and r["world"] >= 64]
        if len(timed) >= 2:
            steps = [
                b["dcp_global_plan_s"] / a["dcp_global_plan_s"]
                for a, b in itertools.pairwise(timed)
            ]
            text += (
                f" DCP's own planner, on the same plans, grew {span(steps)} per doubling of the "
                f"ranks from {timed[0]['world']} to {timed[-1]['world']} ({m})."
            )
            break
    return "\n".join(lines) + "\n\n" + para(text)


def planning_parse(data: dict) -> str:
    lines = head(
        "model, ranks", "`.metadata`", "parse", "structure checks", "global planning (same run)"
    )
    for m in _models(data):
        for r in _shown(data, m, smallest=256):
            lines.append(
                f"| {m}, {r['world']}{_star(r)} | {size3(r['metadata_bytes'])} "
                f"| {seconds(r['load_parse_s'])} | {seconds(r['load_check_s'])} "
                f"| {seconds(r['global_plan_s'])} |"
            )
    text = (
        f"Growth exponents from 32 ranks on, {_names(data)}: parse "
        f"{_growth(data, 'load_parse_s')}, checks {_growth(data, 'load_check_s')}."
    )
    return "\n".join(lines) + "\n\n" + para(text)


def planning_index(data: dict) -> str:
    lines = head(
        "model, ranks", "`.metadata`, pickled in", "index, made in",
        "one rank's load: parse / index", "verified: all checks / its share",
    )  # fmt: skip
    for m in _models(data):
        for r in _shown(data, m, smallest=256):
            pickled = f", {seconds(r['metadata_s'])}" if "metadata_s" in r else ""
            lines.append(
                f"| {m}, {r['world']}{_star(r)} | {size3(r['metadata_bytes'])}{pickled} "
                f"| {size3(r['index_bytes'])}, {seconds(r['index_s'])} "
                f"| {seconds(r['load_parse_s'])} / {seconds(r['load_index_s'])} "
                f"| {seconds(r['load_check_s'])} / {seconds(r['index_check_s'])} |"
            )
    measured = [r for r in data["rows"] if r["measured"]]
    largest = _models(data)[-1]
    mine = [r for r in measured if r["model"] == largest]
    text = (
        f"Growth exponents, {_names(data)}: a rank's load from the index "
        f"{_growth(data, 'load_index_s')}, its share of the checks "
        f"{_growth(data, 'index_check_s')}; the index {_growth(data, 'index_bytes')} in size and "
        f"{_growth(data, 'index_s')} in time to make. A {largest} rank's load finds its "
        f"{mine[-1]['index_chunks']} chunks in "
        f"{seconds_span([r['load_index_s'] for r in mine])} at every world size measured. The "
        "coordinator of every save makes the index in "
        f"{span([r['index_s'] / r['metadata_s'] for r in measured])} the time it takes to "
        "build the storage entries and pickle `.metadata`, and the index adds "
        f"{span([r['index_bytes'] / r['metadata_bytes'] for r in measured])} the size of "
        "`.metadata` to the folder."
    )
    return "\n".join(lines) + "\n\n" + para(text)


def _largest_model(data: dict) -> tuple[str, list[dict]]:
    m = _models(data)[-1]
    return m, _shown(data, m, smallest=64)


def planning_restart(data: dict) -> str:
    m, rows = _largest_model(data)
    lines = head(
        f"{m}, ranks",
        "a restart's first save, before: planned again",
        "after: plannings; each rank's plan, from the index; plans gathered; the coordinator's "
        "metadata, from the index, while the ranks write",
    )
    known = [r for r in _rows(data, m) if "cached_gathered_bytes" in r]
    per_rank = known[-1]["cached_gathered_bytes"] / known[-1]["world"]  # an empty plan each
    for r in rows:
        gathered = (
            size3(r["cached_gathered_bytes"])
            if "cached_gathered_bytes" in r
            else size3(per_rank * r["world"]) + STAR
        )
        lines.append(
            f"| {r['world']}{_star(r)} | 1 planning, {seconds(r['global_plan_s'])}, "
            f"{size3(r['gathered_bytes'])} | 0; {seconds(r['restart_claim_s'])}; {gathered}; "
            f"{seconds(r['restart_metadata_s'])} |"
        )
    measured = [r for r in _rows(data, m) if r["measured"]]
    text = (
        f"A rank in the middle of the mesh takes its plan from the index in "
        f"{seconds_span([r['restart_claim_s'] for r in measured])} at every size measured of "
        f"{m} + AdamW; the coordinator builds the metadata from the index in "
        f"{span([r['restart_metadata_s'] / r['global_plan_s'] for r in measured])} the "
        "planning's time, no longer before any rank may write."
    )
    return "\n".join(lines) + "\n\n" + para(text)


def planning_first_save(data: dict) -> str:
    m, rows = _largest_model(data)
    lines = head(
        f"{m}, ranks",
        "before: the coordinator's planning (blocking), plans gathered, its peak memory",
        "after: blocking, plans gathered, peak memory while blocking",
        "after: `.metadata` streamed (its size, time), write results received, peak memory",
    )
    for r in rows:
        s = _star(r)
        dcp = f"{size3(r['metadata_bytes'])}{s}" + (
            f" in {seconds(r['metadata_s'])}" if "metadata_s" in r else ""
        )
        lines.append(
            f"| {r['world']} | {seconds(r['global_plan_s'])}{s}, {size3(r['gathered_bytes'])}{s}, "
            f"{size3(r['peak_bytes'])}{s} | {seconds(r['described_blocking_s'])}, "
            f"{size3(r['described_gathered_bytes'])}, "
            f"{r['described_blocking_peak_bytes'] / MIB:.0f} MiB "
            f"| {size3(r['described_metadata_bytes'])} in {seconds(r['described_metadata_s'])} "
            f"(DCP's: {dcp}), {size3(r['described_results_bytes'])}, "
            f"{r['described_peak_bytes'] / GIB:.2f} GiB |"
        )
    first, last = rows[0], rows[-1]
    measured = [r for r in _rows(data, m) if r["measured"]]
    ratio = {r["world"]: r["described_metadata_bytes"] / r["metadata_bytes"] for r in measured}
    small, large = min(ratio), max(ratio)
    text = (
        f"The blocking part, on the coordinator: describing its own plan and checking the formula "
        f"against it ({seconds(first['described_describe_s'])} at {first['world']} ranks, "
        f"{seconds(last['described_describe_s'])} at {last['world']}), taking its share from the "
        f"reduced digests ({seconds(first['described_share_s'])}, "
        f"{seconds(last['described_share_s'])}), planning the per-rank states every rank sends "
        f"({seconds(first['described_plan_s'])}, {seconds(last['described_plan_s'])}). The write "
        f"results come to {last['described_results_bytes'] / last['described_chunks']:.0f} bytes "
        f"a chunk ({last['described_chunks'] / 1e6:.1f} M chunks at {last['world']} ranks). The "
        f"streamed `.metadata` is {ratio[small]:.2f}x the size of DCP's own pickle at {small} "
        f"ranks, {ratio[large]:.2f}x at {large}."
    )
    return "\n".join(lines) + "\n\n" + para(text)


def planning_replicas(data: dict) -> str:
    reads = data["reads"]
    lines = head("replicas", *(str(r["replicas"]) for r in reads))
    for label, side in (
        ("before: each rank reads what it needs", "each"),
        ("after: each record read once, shared", "shared"),
    ):
        cells = " | ".join(f"{r[f'{side}_read']} ({r[f'{side}_ratio']:.2f}x)" for r in reads)
        lines.append(f"| {label} | {cells} |")
    return f"A {reads[0]['stored']} checkpoint:\n\n" + "\n".join(lines) + "\n"


def metadata_verify(data: dict) -> str:
    rows = {r["world"]: r for r in data["rows"]}
    small = rows[min(rows)]
    whole_per_chunk = (small["verify_whole_peak_bytes"] - small["verify_start_bytes"]) / small[
        "verify_chunks"
    ]
    lines = head(
        "405B, ranks", "chunks", "`.metadata`", "arrays", "reading and checks in arrays",
        "the same on DCP's objects",
    )  # fmt: skip
    per_chunk = []
    for world, r in sorted(rows.items()):
        arrays = f"{r['verify_s']:.0f} s, peak {r['verify_peak_bytes'] / GIB:.2f} GiB"
        if "verify_whole_s" in r:
            whole = (
                f"{r['verify_whole_s']:.0f} s, peak {r['verify_whole_peak_bytes'] / GIB:.2f} GiB"
            )
        else:
            guess = whole_per_chunk * r["verify_chunks"] / GIB
            whole = f"(about {guess:.0f} GiB above the start, extrapolated)"
        lines.append(
            f"| {world} | {r['verify_chunks'] / 1e6:.3g} M | {size(r['described_metadata_bytes'])}"
            f" | {size(r['verify_arrays_bytes'])} | {arrays} | {whole} |"
        )
        per_chunk.append(
            (world, (r["verify_peak_bytes"] - r["verify_start_bytes"]) / r["verify_chunks"])
        )
    (w1, b1), (w2, b2) = per_chunk[0], per_chunk[-1]
    ratio = small["verify_s"] / small["verify_whole_s"]
    lines += [
        "",
        f"In arrays the peak above the process's start is {b1:.0f} bytes a chunk at {w1} ranks "
        f"and {b2:.0f} at\n{w2}, against {whole_per_chunk:.0f} with DCP's objects; the time is "
        f"{ratio:.2f}x theirs (each tensor's entry is built\nonce per check that asks for it).",
    ]
    return "\n".join(lines) + "\n"
