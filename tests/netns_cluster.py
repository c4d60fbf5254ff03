"""A real multi-node cluster on one machine, for tests: network namespaces joined by a bridge,
an OpenSSH server in each, reached through ``ssh`` aliases in a generated ssh config.

Needs root, iproute2 and openssh-server (``.ci/run`` installs them). Nodes share the process
table. With ``share`` (a folder: the artifact root), node 0 keeps it on its own disk and every
other node sees it only through ``sshfs`` (Debian's sshfs, FUSE over the namespace network,
default options: names and attributes cached for 20 s, no locks across nodes) from a file server
of its own, an sshd in this machine's own namespace on the bridge's address (a cluster's file
server is not node 0: node 0 cut off leaves the other nodes their share), mounted at the same path
in that node's own mount namespace, in which its sshd and so every session there runs: a
cluster's shared file system as it is, not one coherent disk. :meth:`NamespaceCluster.lose_share`
kills a node's sshfs client (the share then answers ENOTCONN there, as a crashed client's does);
:meth:`NamespaceCluster.cut` sets a node's link down (its packets vanish, no connection is closed).
``clock_offsets`` ({node index: "+30s"}) give every session on a node a clock that far off (libfaketime, Debian's
``faketime``, through the node's sshd_config ``SetEnv``). libfaketime 0.9.10 shifts
CLOCK_MONOTONIC too, and ``time.sleep`` with it, but not a lock's timed wait (``sem_clockwait``):
there a thread's 2 s ``Event.wait`` or ``Thread.join`` lasts 32 s, so the supervisor times its
threads with sleeps (orchestration/node/board.py ``join_within``); with
``FAKETIME_DONT_FAKE_MONOTONIC=1`` every ``time.sleep`` fails with EINVAL instead. Everything created here is named with a
per-process prefix and torn down by :meth:`NamespaceCluster.close`, also after a failure.
Addresses are private (10.213.x.0/24) and exist only inside these namespaces.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
FILE_SERVER_PORT = 2222
"""The file server's sshd, on the bridge's address (one per cluster: each has its own subnet)."""
SSHFS = "/usr/bin/sshfs"
LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def missing_prerequisites(share: bool = False, clock: bool = False) -> str | None:
    if share and not (Path(SSHFS).exists() and Path("/dev/fuse").exists()):
        return "needs sshfs and /dev/fuse (apt-get install sshfs)"
    if clock and not Path(LIBFAKETIME).exists():
        return "needs libfaketime (apt-get install faketime)"
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install iproute2 openssh-client)"
    if not Path(SSHD).exists():
        return "needs sshd (apt-get install openssh-server)"
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


@dataclass
class Node:
    alias: str
    namespace: str
    address: str
    sshd_pid_file: Path
    sshd_config: Path


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and has not ended (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def _free_subnet(start: int) -> str:
    """The first 10.213.N (N from ``start``) no interface of this machine has an address in: two
    clusters may be up at once (the suite's two workers)."""
    shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for n in ((start + k) % 250 for k in range(250)):
        if f" 10.213.{n}." not in shown:
            return f"10.213.{n}"
    raise RuntimeError("every 10.213.N/24 is in use on this machine")


class NamespaceCluster:
    def __init__(self, num_nodes: int, workdir: Path, interface: str = "eth0", share: Path | None = None,
                 clock_offsets: dict[int, str] | None = None):
        self.workdir = workdir
        self.interface = interface
        self.share = share
        self.clock_offsets = dict(clock_offsets or {})
        tag = os.getpid() % 10000
        self.prefix = f"mz{tag}"
        self.subnet = _free_subnet(tag % 250)
        self.bridge = f"{self.prefix}br"
        self.nodes = [
            Node(f"node{i}", f"{self.prefix}n{i}", f"{self.subnet}.{i + 1}",
                 workdir / f"sshd{i}.pid", workdir / f"sshd{i}.conf")
            for i in range(num_nodes)
        ]
        self.ssh_config = workdir / "ssh_config"
        self.file_server = Node("fileserver", "", f"{self.subnet}.254", workdir / "sshd_fs.pid", workdir / "sshd_fs.conf")
        """The share's server: an sshd on the bridge's address, in this machine's namespace."""
        self._created_bridge = False

    # -- setup -------------------------------------------------------------------------------
    def open(self) -> "NamespaceCluster":
        try:
            self._network()
            self._ssh()
        except BaseException:
            self.close()
            raise
        return self

    def _network(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._created_bridge = True
        _sh("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for i, node in enumerate(self.nodes):
            self._add_namespace(i, node)

    def hosts_file(self, node: Node) -> Path:
        """The node's /etc/hosts: ``ip netns exec`` binds /etc/netns/NAME/hosts over /etc/hosts for
        what it runs (the node's sshd, so its sessions): this machine's, plus every node's name."""
        return Path("/etc/netns") / node.namespace / "hosts"

    def set_hosts(self, node: Node, names: dict[str, str] | None = None) -> None:
        """Rewrite ``node``'s hosts file in place (the bind mount follows the inode): every node's
        name at its address, then ``names`` (name -> address) over them, as a cluster's DNS or a
        node's stale /etc/hosts would."""
        mapping = {n.alias: n.address for n in self.nodes} | dict(names or {})
        base = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
        with open(self.hosts_file(node), "w") as f:
            f.write(base.rstrip("\n") + "\n" + "".join(f"{address} {name}\n" for name, address in mapping.items()))

    def _add_namespace(self, i: int, node: Node) -> None:
        host_end = f"{self.prefix}v{i}"
        self.hosts_file(node).parent.mkdir(parents=True, exist_ok=True)
        self.set_hosts(node)
        _sh("ip", "netns", "add", node.namespace)
        _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", self.interface, "netns", node.namespace)
        _sh("ip", "link", "set", host_end, "master", self.bridge)
        _sh("ip", "link", "set", host_end, "up")
        inside = ("ip", "netns", "exec", node.namespace)
        _sh(*inside, "ip", "addr", "add", f"{node.address}/24", "dev", self.interface)
        _sh(*inside, "ip", "link", "set", self.interface, "up")
        _sh(*inside, "ip", "link", "set", "lo", "up")

    def _ssh(self) -> None:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation dir
        key, host_key = self.workdir / "id_ed25519", self.workdir / "host_ed25519"
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key))
        authorized = self.workdir / "authorized_keys"
        authorized.write_text(Path(f"{key}.pub").read_text())
        authorized.chmod(0o600)
        config_lines = []
        for node in self.nodes:
            node.sshd_config.write_text("\n".join([
                f"ListenAddress {node.address}", "Port 22", f"HostKey {host_key}", f"PidFile {node.sshd_pid_file}",
                f"AuthorizedKeysFile {authorized}", "UsePAM no", "StrictModes no", "PermitRootLogin yes",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
                "LogLevel ERROR", "MaxStartups 100", "MaxSessions 100", "Subsystem sftp internal-sftp",
                *([f"SetEnv LD_PRELOAD={LIBFAKETIME} FAKETIME={self.clock_offsets[self.nodes.index(node)]}"]
                  if self.nodes.index(node) in self.clock_offsets else []), "",
            ]))
            config_lines += [
                f"Host {node.alias}", f"  HostName {node.address}", "  User root", f"  IdentityFile {key}",
                "  IdentitiesOnly yes", "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null", "  LogLevel ERROR", "",
            ]
        self.ssh_config.write_text("\n".join(config_lines))
        if self.share is not None:  # the file server first: the nodes mount the share from it
            self.file_server.sshd_config.write_text("\n".join([
                f"ListenAddress {self.file_server.address}", f"Port {FILE_SERVER_PORT}", f"HostKey {host_key}",
                f"PidFile {self.file_server.sshd_pid_file}", f"AuthorizedKeysFile {authorized}", "UsePAM no",
                "StrictModes no", "PermitRootLogin yes", "PasswordAuthentication no", "LogLevel ERROR",
                "MaxStartups 100", "Subsystem sftp internal-sftp", ""]))
            _sh(SSHD, "-f", str(self.file_server.sshd_config), "-E", str(self.workdir / "fileserver.sshd.log"))
        for node in self.nodes:
            self.start_sshd(node)
            self.wait_for_ssh(node)

    def start_sshd(self, node: Node, mounts: list[tuple[str, str]] = ()) -> None:
        """The node's sshd; with ``mounts`` ((source or "tmpfs", target) pairs) in a mount namespace
        of its own, so that what runs over ssh on this node sees another file system there (a
        file missing on one node, a package of another version, an artifact root not shared)."""
        sshd = [SSHD, "-f", str(node.sshd_config), "-E", str(self.workdir / f"{node.alias}.sshd.log")]
        shared = self.share is not None and node is not self.nodes[0]
        if not mounts and not shared:
            _sh("ip", "netns", "exec", node.namespace, *sshd)
            return
        steps = [f"mount -t tmpfs tmpfs {shlex.quote(target)}" if source == "tmpfs"
                 else f"mount --bind {shlex.quote(source)} {shlex.quote(target)}" for source, target in mounts]
        if shared:  # the file server's folder through SFTP, at the same path (facts.md: shared file systems)
            options = (f"IdentityFile={self.workdir / 'id_ed25519'},StrictHostKeyChecking=no,"
                       f"UserKnownHostsFile=/dev/null,LogLevel=ERROR,port={FILE_SERVER_PORT}")
            client = self.share_client_pid_file(node)
            client.unlink(missing_ok=True)
            # in the foreground, in the background of this shell: its pid recorded (lose_share), and
            # the mount there before sshd starts
            steps.insert(0, shlex.join([SSHFS, "-f", "-o", options, f"root@{self.file_server.address}:{self.share}",
                                        str(self.share)]) + f" >/dev/null 2>&1 & echo $! > {shlex.quote(str(client))}; "
                         f"n=0; until grep -qs ' {self.share} fuse.sshfs ' /proc/self/mounts; do n=$((n+1)); "
                         "[ $n -gt 200 ] && exit 1; sleep 0.05; done")
        script = " && ".join([*steps, "exec " + shlex.join(sshd)])
        _sh("ip", "netns", "exec", node.namespace, "unshare", "--mount", "--propagation", "private", "sh", "-c", script)

    def share_client_pid_file(self, node: Node) -> Path:
        return self.workdir / f"{node.alias}.sshfs.pid"

    def lose_share(self, node: Node) -> int:
        """The node's sshfs client SIGKILLed (its pid recorded when it was started): the share
        answers ENOTCONN in every session of that node. The pid killed."""
        pid = int(self.share_client_pid_file(node).read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)  # a stopped one (hang_share) goes too
        return pid

    def hang_share(self, node: Node) -> int:
        """The node's sshfs client SIGSTOPped: every call on the share there waits (a hard-mounted NFS
        whose server is gone), until :meth:`lose_share` or a restart of the node's sshd. Its pid."""
        pid = int(self.share_client_pid_file(node).read_text().split()[0])
        os.kill(pid, signal.SIGSTOP)
        return pid

    def cut(self, node: Node) -> None:
        """The node's link down (its veth's end on the bridge): its packets vanish, nothing is
        closed, as when a switch port or a cable goes."""
        _sh("ip", "link", "set", f"{self.prefix}v{self.nodes.index(node)}", "down")

    def mend(self, node: Node) -> None:
        _sh("ip", "link", "set", f"{self.prefix}v{self.nodes.index(node)}", "up")

    def mounted_share(self, node: Node) -> bool:
        """Whether ``share`` is an sshfs mount in the sessions of ``node``."""
        proc = subprocess.run(["ssh", "-F", str(self.ssh_config), node.alias, "grep", "-c", "fuse.sshfs", "/proc/self/mounts"],
                              capture_output=True, text=True, timeout=30)
        return proc.returncode == 0 and int(proc.stdout.strip() or 0) > 0

    def wait_for_ssh(self, node: Node, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            proc = subprocess.run(["ssh", "-F", str(self.ssh_config), "-o", "ConnectTimeout=3", node.alias, "true"],
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"ssh to {node.alias} did not come up: {proc.stderr}")
            time.sleep(0.3)

    # -- helpers for tests --------------------------------------------------------------------
    @property
    def ssh_opts(self) -> str:
        return f"-F {self.ssh_config}"

    def sshd_pids(self, node: Node) -> list[int]:
        """The node's sshd listener and every sshd process under it (its connections)."""
        try:
            root = int(node.sshd_pid_file.read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return []
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                ppid = int(stat[stat.rindex(")") + 2:].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
        out, todo = [], [root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += [c for c in children.get(pid, []) if Path(f"/proc/{c}/comm").exists()
                     and Path(f"/proc/{c}/comm").read_text().strip().startswith("sshd")]
        return out

    def kill_sshd(self, node: Node, timeout_s: float = 30.0) -> list[int]:
        """The node's sshd and its sessions SIGKILLed, and gone: a session blocked on a broken share
        ends only once its call returns, and holds port 22 until then (the next sshd's bind failed
        with "Address already in use" on a loaded machine)."""
        pids = self.sshd_pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.sshd_pid_file.unlink(missing_ok=True)
        deadline = time.monotonic() + timeout_s
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return pids

    def namespace_pids(self, node: Node) -> list[int]:
        proc = _sh("ip", "netns", "pids", node.namespace, check=False)
        return [int(p) for p in proc.stdout.split()]

    def lose(self, node: Node) -> list[int]:
        """The node is gone for good, as a dead board or a drained machine: every process in its
        namespace (its supervisor, torchrun, its ranks, its sshd) SIGKILLed, then the namespace
        deleted. The pids killed."""
        pids = sorted(set(self.namespace_pids(node)) | set(self.kill_sshd(node)))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _sh("ip", "netns", "del", node.namespace, check=False)
        return pids

    def restore(self, node: Node) -> None:
        """A node :meth:`lose` removed, back (for the module's later tests)."""
        self._add_namespace(self.nodes.index(node), node)
        self.start_sshd(node)
        self.wait_for_ssh(node)

    def throttle(self, node: Node, rate: str) -> None:
        """The node's outgoing traffic held to ``rate`` (tc's token bucket filter, e.g. ``20mbit``):
        a slow link, as a port at a lower speed or a bad cable makes it."""
        _sh("ip", "netns", "exec", node.namespace, "tc", "qdisc", "replace", "dev", self.interface, "root", "tbf",
            "rate", rate, "burst", "64kb", "latency", "400ms")

    def throttle_share(self, node: Node, rate: str) -> None:
        """The node's traffic to the file server alone held to ``rate`` (an htb qdisc whose class for
        the server's address has that rate; the rest, training's traffic included, a class of
        10 Gbit/s; this kernel has htb and u32, not prio, tbf's ``handle`` or netem): slow storage on
        a fast network."""
        netns = ("ip", "netns", "exec", node.namespace, "tc")
        dev = ("dev", self.interface)
        _sh(*netns, "qdisc", "replace", *dev, "root", "handle", "1:", "htb", "default", "20")
        _sh(*netns, "class", "add", *dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate)
        _sh(*netns, "class", "add", *dev, "parent", "1:", "classid", "1:20", "htb", "rate", "10gbit")
        _sh(*netns, "filter", "add", *dev, "parent", "1:", "protocol", "ip", "u32", "match", "ip", "dst",
            f"{self.file_server.address}/32", "flowid", "1:10")

    def unthrottle(self, node: Node) -> None:
        _sh("ip", "netns", "exec", node.namespace, "tc", "qdisc", "del", "dev", self.interface, "root", check=False)

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        self.kill_sshd(self.file_server)
        for node in self.nodes:
            self.kill_sshd(node)
            for pid in self.namespace_pids(node):  # anything a failed test left in our namespace
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _sh("ip", "netns", "del", node.namespace, check=False)
            shutil.rmtree(self.hosts_file(node).parent, ignore_errors=True)
        if self._created_bridge:
            _sh("ip", "link", "del", self.bridge, check=False)
        # A namespace goes once its last user has (a killed process still exiting, a FUSE mount):
        # its veth pair with it. Another cluster of this process takes the same names: wait.
        deadline = time.monotonic() + 30
        while f" {self.prefix}" in _sh("ip", "-o", "link", "show", check=False).stdout and time.monotonic() < deadline:
            time.sleep(0.2)
