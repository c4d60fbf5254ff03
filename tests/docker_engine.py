"""A real Docker engine on this machine, for tests: ``dockerd`` (Debian's docker.io) as root with
its own data root, exec root, socket and pid file, started with ``--iptables=false --bridge=none``
so it leaves the firewall alone (its defaults drop the traffic between the namespace nodes), and
one container that runs the machine's own Python: no image registry is reachable, so the image is
imported from an empty root tarball and the container bind-mounts ``/usr``, ``/lib``, ``/lib64``,
``/bin``, ``/etc``, the interpreter's trees (a venv's and the Python it was made from, each under
the name given and its resolved name), the project and ``/tmp``. Everything it starts is
removed by :meth:`DockerEngine.close`. Needs root and ``apt-get install docker.io``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

DOCKERD = "dockerd"


def missing_prerequisites() -> str | None:
    if os.geteuid() != 0:
        return "needs root (dockerd)"
    if shutil.which(DOCKERD) is None or not Path("/usr/bin/docker").exists():
        return "needs dockerd and docker (apt-get install docker.io)"
    return None


def interpreter_trees() -> list[str]:
    """Where this interpreter and its packages live: the venv (``sys.prefix``) and the Python it
    was made from (``sys.base_prefix``, e.g. pyenv's, outside /usr), each as given and resolved."""
    trees = []
    for prefix in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                   str(Path(os.path.realpath(sys.executable)).parent.parent)):
        trees += [prefix, str(Path(prefix).resolve())]
    return list(dict.fromkeys(trees))


class DockerEngine:
    def __init__(self, workdir: Path, repo: Path, container: str = "megatron-training"):
        self.workdir, self.repo, self.container = workdir, repo, container
        # Unix socket paths hold 107 bytes, and containerd's lies four folders under the exec root
        # (``containerd/containerd.sock.ttrpc``): under a long TMPDIR (a user's clone, a CI job's
        # workspace) it does not fit and dockerd never comes up. The exec root and the daemon's
        # socket go to a short folder of their own under /tmp, removed by close().
        self.short = Path(tempfile.mkdtemp(prefix="mzd-", dir="/tmp"))
        self.socket = self.short / "docker.sock"
        self.pid_file = workdir / "dockerd.pid"
        self.image = "mz-empty-root:latest"

    @property
    def env(self) -> dict[str, str]:
        """What a ``docker`` client needs to reach this daemon."""
        return {"DOCKER_HOST": f"unix://{self.socket}"}

    def docker(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["/usr/bin/docker", *args], env={**os.environ, **self.env}, check=check,
                              capture_output=True, text=True, timeout=120)

    def open(self) -> "DockerEngine":
        try:
            self._daemon()
            self._container()
        except BaseException:
            self.close()
            raise
        return self

    def _daemon(self) -> None:
        log = open(self.workdir / "dockerd.log", "wb")
        self._proc = subprocess.Popen(
            [DOCKERD, "--iptables=false", "--bridge=none", "--data-root", str(self.workdir / "data"),
             "--exec-root", str(self.short / "exec"), "-H", f"unix://{self.socket}", "--pidfile", str(self.pid_file)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while self.docker("info", check=False).returncode != 0:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not come up: {(self.workdir / 'dockerd.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def _container(self) -> None:
        root = self.workdir / "root"
        for d in ("proc", "sys", "dev", "tmp", "etc", "work", "root"):
            (root / d).mkdir(parents=True, exist_ok=True)
        tarball = self.workdir / "root.tar"
        with tarfile.open(tarball, "w") as tar:
            tar.add(root, arcname=".")
        self.docker("import", str(tarball), self.image)
        mounts = ["/usr", "/lib", "/lib64", "/bin", "/etc", *interpreter_trees()]
        args = ["run", "-d", "--name", self.container, "--network", "host"]
        for path in dict.fromkeys(mounts):
            if Path(path).exists():
                args += ["-v", f"{path}:{path}:ro"]
        for path in dict.fromkeys([str(self.repo), str(Path(self.repo).resolve())]):
            args += ["-v", f"{path}:{path}"]
        args += ["-v", "/tmp:/tmp", self.image, "/bin/sleep", "infinity"]
        self.docker(*args)
        check = self.docker("exec", self.container, sys.executable, "-c", "import torch, megatron.core", check=False)
        if check.returncode:
            raise RuntimeError(
                f"the test container cannot run this interpreter ({sys.executable}): {check.stderr.strip()[-500:]}; "
                f"it mounts {', '.join(dict.fromkeys(mounts))}: put the interpreter and its packages under one of "
                "those, or run the tests from an interpreter whose files they hold")

    def close(self) -> None:
        self.docker("rm", "-f", self.container, check=False)
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # dockerd leaves its network-namespace mount under the exec root: unmount what lies under ours.
        for line in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            target = line.split()[1]
            if target.startswith((f"{self.workdir}/", f"{self.short}/")):
                subprocess.run(["umount", "-l", target], capture_output=True)
        shutil.rmtree(self.short, ignore_errors=True)
