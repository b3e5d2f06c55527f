"""The figures of the weight-push page (docs/engines.md): the push beside a restart and a path
reload (``benchmarks/weight_push.py``), and the RL example's steps (``examples/rl_loop.py``)."""

from __future__ import annotations

from _format import head, millions, para, seconds, size3, times


def weight_push(data: dict) -> str:
    opts = data["options"]
    lines = [
        para(
            f"Llama 3 shapes in bfloat16, one trainer process and one vLLM server (CPU) on this "
            f"machine's 2 cores; buckets of {opts['bucket_size']}; medians of "
            f"{opts['repeats']}. A restart and a path reload both first write the step as a "
            "Hugging Face folder (its time is in both)."
        ).rstrip("\n"),
        "",
    ]
    lines += head("model", "bytes", "push", "of which the swap", "GB/s", "restart", "x the push",
                  "path reload", "x the push")  # fmt: skip
    for shape, r in data["results"].items():
        restart, reload = r["export_s"] + r["restart_s"], r["export_s"] + r["reload_s"]
        lines.append(
            f"| {shape} ({millions(r['params'])}) | {size3(r['bytes'])} | "
            f"{seconds(r['push_s'])} | {seconds(r['swap_s'])} | {r['push_gb_s']:.2f} | "
            f"{seconds(restart)} | "
            f"{times(restart / r['push_s'])}x | {seconds(reload)} | "
            f"{times(reload / r['push_s'])}x |"
        )
    lines += ["", *head("model", "stall per push: `push`", "`push_async`", "a copy of the model",
                        "peak extra, trainer", "largest bucket", "peak extra, engine")]  # fmt: skip
    for shape, r in data["results"].items():
        lines.append(
            f"| {shape} | {seconds(r['push_s'])} | {seconds(r['async_stall_s'])} | "
            f"{seconds(r['staging_s'])} | "
            f"{size3(r['trainer_peak_bytes'])} | {size3(r['largest_bucket'])} | "
            f"{size3(r['engine_peak_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def rl_loop(data: dict) -> str:
    lines = head("step", "mean reward", "generation", "push", "pushed")
    for r in data["results"]:
        lines.append(
            f"| {r['step']} | {r['reward']:.3f} | {seconds(r['generate_s'])} | "
            f"{seconds(r['push_s'])} | {r['push_mb']:.1f} MB |"
        )
    return "\n".join(lines) + "\n"
