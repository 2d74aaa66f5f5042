"""Commands on the cluster's submit side: here, or on a login node through ssh."""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

SSH_OPTIONS = ("-o", "BatchMode=yes")


class LocalShell:
    """The submitter is on a login node: commands and files are local."""

    def argv(self, cmd: Sequence[str]) -> list[str]:
        return list(cmd)

    def run(
        self, cmd: Sequence[str], *, input: bytes | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[bytes]:
        result = subprocess.run(self.argv(cmd), input=input, capture_output=True, timeout=timeout)
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, self.argv(cmd), result.stdout, result.stderr)
        return result

    def stage(self, folder: str, files: Mapping[str, bytes]) -> None:
        path = Path(folder)
        path.mkdir(mode=0o700, parents=True, exist_ok=False)
        for name, data in files.items():
            fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)

    def read_bytes(self, path: str) -> bytes | None:
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None

    def rename(self, src: str, dst: str) -> None:
        # not fsutil.atomic_write: renames a staged file to the name submitit's entry point waits for
        os.rename(src, dst)


class SshShell(LocalShell):
    """Commands run on ``host`` through ``ssh -o BatchMode=yes``; files travel as a tar stream."""

    def __init__(self, host: str, ssh: str = "ssh") -> None:
        self.host = host
        self.ssh = ssh

    def argv(self, cmd: Sequence[str]) -> list[str]:
        # "--" before the host: OpenSSH stops option parsing at the host, so it cannot go after it.
        return [self.ssh, *SSH_OPTIONS, "--", self.host, shlex.join(cmd)]

    def stage(self, folder: str, files: Mapping[str, bytes]) -> None:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mode = 0o600
                tar.addfile(info, io.BytesIO(data))
        q = shlex.quote(folder)
        parent = shlex.quote(os.path.dirname(folder))
        script = f"umask 077 && mkdir -p {parent} && mkdir {q} && tar -xf - -C {q}"
        self.run(["sh", "-c", script], input=buffer.getvalue())

    def read_bytes(self, path: str) -> bytes | None:
        result = self.run(["cat", path], check=False)
        return result.stdout if result.returncode == 0 else None

    def rename(self, src: str, dst: str) -> None:
        self.run(["mv", "--", src, dst])
