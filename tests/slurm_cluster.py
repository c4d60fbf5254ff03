"""A real Slurm on this machine, for tests: munged, slurmctld and one slurmd (Debian's slurm-wlm
22.05), each with its own config, key, spool, state, pid and log files under a work directory,
started here and stopped by :meth:`SlurmCluster.close`, also after a failure.

One node (this machine, 2 CPUs) running one task with 2 training processes: several slurmd per
network namespace were not set up here, so the multi-node side of the srun transport is tested
over ssh instead (tests/test_multinode.py). Needs root and ``apt-get install slurmctld slurmd
munge slurm-client`` (``.ci/run`` installs them).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing_prerequisites() -> str | None:
    if os.geteuid() != 0:
        return "needs root (slurmd, munged)"
    for tool in (*DAEMONS, "sbatch", "srun", "scontrol", "scancel", "sinfo"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"needs {tool} (apt-get install slurmctld slurmd munge slurm-client)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(tool: str) -> str:
    return shutil.which(tool) or f"/usr/sbin/{tool}"


class SlurmCluster:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.hostname = socket.gethostname().split(".")[0]
        self.conf = workdir / "slurm.conf"
        self.munge_socket = workdir / "munge" / "munge.socket"
        self.pid_files = {name: workdir / f"{name}.pid" for name in DAEMONS}

    @property
    def env(self) -> dict[str, str]:
        """What Slurm's clients need to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def open(self) -> "SlurmCluster":
        try:
            self._munge()
            self._slurm()
        except BaseException:
            self.close()
            raise
        return self

    def _munge(self) -> None:
        munge = self.workdir / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run([_which("munged"), "--force", "--key-file", str(key), "--socket", str(self.munge_socket),
                        "--pid-file", str(self.pid_files["munged"]), "--log-file", str(munge / "munged.log"),
                        "--seed-file", str(munge / "munged.seed")], check=True, capture_output=True, text=True)

    def _slurm(self) -> None:
        w = self.workdir
        for d in ("state", "spool"):
            (w / d).mkdir()
        self.conf.write_text("\n".join([
            "ClusterName=mz",
            f"SlurmctldHost={self.hostname}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "SlurmUser=root", "SlurmdUser=root",
            # cred_expire: a requeued job waits this long (+1 s) before it may start again (22.05 holds it
            # for the credential window, 120 s by default); 10 s keeps the time-limit test short.
            "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket},cred_expire=10", "CryptoType=crypto/munge",
            f"StateSaveLocation={w / 'state'}", f"SlurmdSpoolDir={w / 'spool'}/%n",
            f"SlurmctldPidFile={self.pid_files['slurmctld']}", f"SlurmdPidFile={self.pid_files['slurmd']}",
            f"SlurmctldLogFile={w / 'slurmctld.log'}", f"SlurmdLogFile={w / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "ReturnToService=2", "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
            "MinJobAge=600", "KillWait=10",
            f"NodeName={self.hostname} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES State=UP",
            "",
        ]))
        env = {**os.environ, **self.env}
        subprocess.run([_which("slurmctld"), "-f", str(self.conf)], check=True, env=env, capture_output=True, text=True)
        subprocess.run([_which("slurmd"), "-f", str(self.conf)], check=True, env=env, capture_output=True, text=True)
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout.strip()
            if state in ("idle", "mix", "alloc"):
                return
            if time.monotonic() > deadline:
                log = (self.workdir / "slurmctld.log").read_text()[-2000:] if (self.workdir / "slurmctld.log").exists() else ""
                raise RuntimeError(f"slurm did not come up (sinfo: {state!r}); slurmctld log:\n{log}")
            time.sleep(0.5)

    def close(self) -> None:
        for name in reversed(DAEMONS):
            try:
                pid = int(self.pid_files[name].read_text().split()[0])
            except (FileNotFoundError, ValueError, IndexError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
