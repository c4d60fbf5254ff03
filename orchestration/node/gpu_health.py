"""GPU health, the node side: what on this node's GPUs and links would crash or slow a run, each
problem one line with its fix.

    python -m orchestration.node.gpu_health        # this machine's findings and notes, one a line

Read from ``nvidia-smi -q -x`` (volatile uncorrected ECC errors, pages pending retirement, rows
pending remap or a failed remap, the driver's recovery action, a GPU already holding processes or
memory), this boot's kernel log (Xid events), ``nvidia-smi nvlink -s`` (an NVLink link down) and
``ibstat`` or ``/sys/class/infiniband`` (an InfiniBand port not Active). The parsers are pure, text
in and findings out, tested on samples written from the documented formats
(tests/data/gpu_health/). :func:`read_gpu_health` is the one edge: it runs those commands, each
with a timeout, and reads sysfs; a command missing, refused or stuck is a note, never an exception.
Side effects: runs nvidia-smi, journalctl or dmesg, ibstat; reads /sys/class/infiniband.
"""

from __future__ import annotations

import re
import socket
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, NamedTuple

COMMAND_TIMEOUT_S = 20.0
"""How long each command may take; nvidia-smi answers in well under a second on a healthy node,
and one that hangs is itself a sign of a stuck GPU."""
MEMORY_IN_USE_MIB = 1024
"""Framebuffer memory above which an idle GPU counts as held. nvidia-smi's ``fb_memory_usage/used``
excludes the driver's own reservation, which it reports apart as ``reserved`` (R510 and later;
total = reserved + used + free), so an idle GPU shows 0-few MiB used; a CUDA context alone takes
~500 MiB and is listed under ``processes``. Older drivers (no ``reserved``) may count the
reservation in ``used``, hundreds of MiB; 1 GiB stays above both."""
UNCORRECTED_VOLATILE = ("double_bit/total", "dram_uncorrectable", "sram_uncorrectable",
                        "sram_uncorrectable_parity", "sram_uncorrectable_secded")
"""The uncorrected counters under ``ecc_errors/volatile`` (since the driver loaded), by layout:
Volta and older print ``double_bit/total``; Turing and later ``dram_uncorrectable`` with
``sram_uncorrectable`` (nvsmi_device_v11) or its ``_parity``/``_secded`` split (v12)."""
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
"""Xids NVIDIA's k8s-device-plugin treats as the application's error, the GPU still healthy
(internal/rm/health.go): graphics engine exception, memory page fault, stopped processing,
preemptive cleanup, video processor exception."""
XID_ACTIONS = {
    48: "an uncorrectable (double-bit) ECC error: reset the GPU{reset} or drain the node",
    63: "a row remap (page retirement before Ampere) was recorded: reset the GPU{reset} to apply it",
    64: "a row remap (page retirement) failed: drain the node and have the GPU serviced",
    74: "an NVLink error: reset the GPU{reset}; if it recurs, drain the node (nvidia-smi nvlink -e)",
    79: "the GPU fell off the bus: reboot the node; if it recurs, drain it (PCIe, power or board)",
    92: "a high single-bit ECC error rate: drain the node when convenient and watch the counters",
    94: "a contained ECC error, the GPU recovered: reset it{reset} when idle",
    95: "an uncontained ECC error: reset the GPU{reset} or drain the node",
    119: "the GPU's firmware (GSP) timed out: reset the GPU{reset} or reboot the node",
    120: "the GPU's firmware (GSP) failed: reset the GPU{reset} or reboot the node",
}
"""What the common hardware Xids ask for (NVIDIA's Xid catalog and GPU memory error management
guide); any other Xid gets the catalog and a reset."""
RECOVERY_ACTIONS = {
    "Reset": "stop its processes and reset it{reset}",
    "Reboot": "reboot the node",
    "Drain P2P": "drain the node of peer-to-peer work, then reset the GPU{reset}",
    "Drain and Reset": "drain the node, then reset the GPU{reset}",
}
"""nvidia-smi's ``gpu_recovery_action`` (NVIDIA's GPU memory error management guide, "Recovery
action flag") -> what to do; ``None`` asks nothing."""

Runner = Callable[..., subprocess.CompletedProcess]


@dataclass(frozen=True)
class GpuFinding:
    """One problem of one GPU (or InfiniBand port) of this node, with its fix."""

    gpu: str
    """Which device: ``GPU 3 (00000000:1B:00.0)``, or ``mlx5_0 port 1`` for an InfiniBand port."""
    what: str
    """What is wrong, with the values read."""
    fix: str
    """What to do about it."""

    def line(self, node_rank: int, host: str) -> str:
        """The finding as the preflight table prints it."""
        return f"node {node_rank} ({host}), {self.gpu}: {self.what}; {self.fix}"


@dataclass(frozen=True)
class GpuHealth:
    """Everything this node's GPU check found, and what it could not read here."""

    findings: tuple[GpuFinding, ...]
    notes: tuple[str, ...]
    """Checks that could not run here and why (``XID events not readable here: ...``): no finding,
    but no all-clear either."""

    def lines(self, node_rank: int, host: str) -> list[str]:
        return ([f.line(node_rank, host) for f in self.findings]
                + [f"node {node_rank} ({host}): {note}" for note in self.notes])


# -- nvidia-smi -q -x ------------------------------------------------------------------------------

def _gpus(xml_text: str) -> list[ET.Element]:
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as exc:
        raise ValueError(f"nvidia-smi -q -x gave no XML this check can read ({exc})") from None
    return root.findall("gpu")


def _text(element: ET.Element, path: str) -> str | None:
    found = element.find(path)
    value = (found.text or "").strip() if found is not None else ""
    return value or None


def _number(value: str | None) -> int | None:
    """``'3'`` or ``'70530 MiB'`` -> the integer; ``N/A`` and the like -> None."""
    match = re.fullmatch(r"(\d+)(?:\s*MiB)?", value or "")
    return int(match.group(1)) if match else None


def _bus_id(gpu: ET.Element) -> str:
    return gpu.get("id") or _text(gpu, "pci/pci_bus_id") or "?"


def gpu_label(index: int | str, bus_id: str | None) -> str:
    """``GPU 3 (00000000:1B:00.0)``: nvidia-smi's index (what ``-i`` takes) and bus id."""
    return f"GPU {index} ({bus_id})" if bus_id else f"GPU {index}"


def gpu_bus_ids(xml_text: str) -> dict[str, str]:
    """nvidia-smi's bus id of each GPU -> its index, the order ``nvidia-smi -q`` lists them in
    (the index ``nvidia-smi -i`` and ``nvidia-smi nvlink -s`` use)."""
    return {_bus_id(gpu): str(index) for index, gpu in enumerate(_gpus(xml_text))}


def _reset(index: int | str) -> str:
    return f" (nvidia-smi -r -i {index}, as root, nothing running on it)"


def _gpu_findings(index: int, gpu: ET.Element) -> list[GpuFinding]:
    label, reset = gpu_label(index, _bus_id(gpu)), _reset(index)
    found = []
    counts = {name: _number(_text(gpu, f"ecc_errors/volatile/{name}")) for name in UNCORRECTED_VOLATILE}
    counts = {name: n for name, n in counts.items() if n}
    if counts:
        detail = ", ".join(f"{name} {n}" for name, n in counts.items())
        total = sum(counts.values())
        found.append(GpuFinding(label, f"{total} uncorrected ECC error{'s' if total > 1 else ''} since the driver loaded "
                                       f"(volatile {detail})", f"reset the GPU{reset} or drain the node"))
    retirement = [name for name in ("pending_blacklist", "pending_retirement") if _text(gpu, f"retired_pages/{name}") == "Yes"]
    if retirement:
        found.append(GpuFinding(label, f"memory pages pending retirement ({', '.join(retirement)}: Yes)",
                                f"reload the driver to retire them: reset the GPU{reset} or reboot the node"))
    if _text(gpu, "remapped_rows/remapped_row_pending") == "Yes":
        rows = _number(_text(gpu, "remapped_rows/remapped_row_unc")) or 0
        found.append(GpuFinding(label, f"a row remap is pending ({rows} row{'s' if rows != 1 else ''} remapped for "
                                       "uncorrectable errors)",
                                f"reset the GPU{reset} or reboot the node to apply it"))
    if _text(gpu, "remapped_rows/remapped_row_failure") == "Yes":
        found.append(GpuFinding(label, "a row remap has failed (the GPU is out of spare rows or could not remap)",
                                "drain the node and have the GPU replaced (NVIDIA's RMA policy for row remapping)"))
    action = _text(gpu, "gpu_recovery_action")
    if action and action not in ("None", "N/A"):
        fix = RECOVERY_ACTIONS.get(action, "see NVIDIA's GPU memory error management guide, then reset it{reset}")
        found.append(GpuFinding(label, f"the driver asks for a recovery action: {action}", fix.format(reset=reset)))
    processes = gpu.findall("processes/process_info")
    for process in processes:
        pid, name = _text(process, "pid") or "?", _text(process, "process_name") or "?"
        used = _text(process, "used_memory")
        found.append(GpuFinding(label, f"process {pid} ({name}) already runs on it" + (f", holding {used}" if used else ""),
                                f"stop process {pid} ({name}) or exclude the node"))
    used_mib = _number(_text(gpu, "fb_memory_usage/used"))
    if not processes and used_mib is not None and used_mib > MEMORY_IN_USE_MIB:
        found.append(GpuFinding(label, f"{used_mib} MiB of its memory in use by no process visible here",
                                "find the holder on the host (another container: nvidia-smi there, or fuser -v /dev/nvidia*) "
                                "or exclude the node"))
    return found


def nvidia_smi_findings(xml_text: str) -> list[GpuFinding]:
    """Every problem ``nvidia-smi -q -x`` shows, GPU by GPU. A value the GPU does not report
    (``N/A``: ECC off, no row remapper before Ampere) is no finding. ValueError if not XML."""
    return [finding for index, gpu in enumerate(_gpus(xml_text)) for finding in _gpu_findings(index, gpu)]


# -- the kernel log's Xid events -------------------------------------------------------------------

_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})[^)]*\): (\d+),\s*(.*)$")
_PCI = re.compile(r"(?:PCI:)?([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})")
_PROCESS_FIELDS = re.compile(r"^(?:pid=[^,]*,\s*)?(?:name=[^,]*,\s*)?")
_XidEvents = NamedTuple("_XidEvents", [("count", int), ("message", str), ("index", str)])  # one GPU's one Xid; index "": not listed


def pci_key(address: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of a PCI address in any of the spellings: nvidia-smi's
    ``00000000:1B:00.0``, the kernel's ``0000:1b:00`` or ``PCI:0000:1b:00``."""
    match = _PCI.match(address.strip())
    return tuple(int(part, 16) for part in match.groups()) if match else None


def xid_findings(kernel_log: str, bus_ids: Mapping[str, str]) -> list[GpuFinding]:
    """One finding per GPU and Xid in ``kernel_log`` (``journalctl -k`` or ``dmesg`` lines such as
    ``NVRM: Xid (PCI:0000:1b:00): 79, pid=..., GPU has fallen off the bus.``): how often, the last
    message, and what NVIDIA says to do. ``bus_ids`` (:func:`gpu_bus_ids`) names the GPU; an address
    nvidia-smi does not list (a GPU off the bus is not listed) is named by its address."""
    by_key = {pci_key(bus): (index, bus) for bus, index in bus_ids.items()}
    seen: dict[tuple[str, int], _XidEvents] = {}  # (gpu label, xid) -> its events
    for line in kernel_log.splitlines():
        match = _XID.search(line)
        if not match:
            continue
        address, code, message = match.group(1), int(match.group(2)), match.group(3).strip()
        key = pci_key(address)
        index, bus = by_key.get(key, (None, None))
        label = (gpu_label(index, bus) if index is not None
                 else "PCI {:04x}:{:02x}:{:02x} (a GPU nvidia-smi does not list now)".format(*key))
        count = seen[(label, code)].count if (label, code) in seen else 0
        seen[(label, code)] = _XidEvents(count + 1, _PROCESS_FIELDS.sub("", message)[:160], index or "")
    findings = []
    for (label, code), (count, message, index) in seen.items():
        reset = _reset(index) if index != "" else ""
        if code in APPLICATION_XIDS:
            fix = ("an application's error (NVIDIA's device plugin keeps the GPU in service): "
                   "nothing to do unless it recurs with a program known to work")
        else:
            fix = XID_ACTIONS.get(code, f"look up Xid {code} in NVIDIA's Xid catalog; reset the GPU{{reset}} "
                                        "or drain the node if it recurs").format(reset=reset)
        times = "once" if count == 1 else f"{count} times"
        findings.append(GpuFinding(label, f"Xid {code} logged {times} since boot (last: {message})", fix))
    return findings


# -- nvidia-smi nvlink -s --------------------------------------------------------------------------

_NVLINK_GPU = re.compile(r"^GPU (\d+): ")
_NVLINK_LINK = re.compile(r"^\s+Link (\d+): (.*?)\s*$")


def nvlink_findings(text: str, bus_ids: Mapping[str, str] | None = None) -> list[GpuFinding]:
    """The GPUs with NVLink links down, from ``nvidia-smi nvlink -s``. A link is up when it shows a
    rate (``26.562 GB/s``); ``<inactive>`` or anything else is not. A GPU is short when it has fewer
    links up than the best-linked GPU of the node, so a node without NVLink (PCIe: no link listed
    or all inactive) finds nothing, nor does a board whose bridges use only some links on every
    GPU alike."""
    links: dict[str, dict[str, bool]] = {}
    current = None
    for line in text.splitlines():
        if gpu := _NVLINK_GPU.match(line):
            current = links.setdefault(gpu.group(1), {})
        elif (link := _NVLINK_LINK.match(line)) and current is not None:
            current[link.group(1)] = "GB/s" in link.group(2)
    best = max((sum(state.values()) for state in links.values()), default=0)
    by_index = {index: bus for bus, index in (bus_ids or {}).items()}
    findings = []
    for index, state in links.items():
        up = sum(state.values())
        if up >= best:
            continue
        down = [link for link, is_up in state.items() if not is_up]
        which = (f"NVLink link {down[0]} down" if len(down) == 1 else f"NVLink links {', '.join(down)} down" if down
                 else "no NVLink link listed")
        findings.append(GpuFinding(gpu_label(index, by_index.get(index)),
                                   f"{which} ({up} of {len(state)} up; the best-linked GPU here has {best})",
                                   f"reset the GPU{_reset(index)}; if it stays down, drain the node "
                                   "(an NVLink or NVSwitch fault: nvidia-smi nvlink -e)"))
    return findings


# -- InfiniBand ports ------------------------------------------------------------------------------

def _port_finding(port: str, state: str, physical: str | None, layer: str | None) -> GpuFinding | None:
    """A finding for an InfiniBand port not Active; an Ethernet (RoCE) port is left alone (an unused
    one is down on many nodes; its netdev says more)."""
    if state in ("Active", "ActiveDefer") or (layer and layer != "InfiniBand"):
        return None
    if physical in ("Polling", "Disabled", "Sleep"):
        fix = "no link: check the cable and the switch port, or exclude the node"
    elif physical == "LinkUp":
        fix = ("the link is up but no subnet manager configured the port: check that one runs (opensm or the "
               "switch's), or exclude the node")
    else:
        fix = "check the cable, the switch port and the subnet manager, or exclude the node"
    return GpuFinding(port, f"InfiniBand port {state}" + (f" (physical state {physical})" if physical else ""), fix)


def ibstat_findings(text: str) -> list[GpuFinding]:
    """The InfiniBand ports ``ibstat`` shows not Active (``CA 'mlx5_0'`` / ``Port 1:`` /
    ``State: Active`` / ``Physical state: LinkUp`` / ``Link layer: InfiniBand``)."""
    ports: list[tuple[str, dict[str, str]]] = []
    ca, fields = None, None
    for line in text.splitlines():
        stripped = line.strip()
        if match := re.fullmatch(r"CA '([^']+)'", stripped):
            ca, fields = match.group(1), None
        elif (match := re.fullmatch(r"Port (\d+):", stripped)) and ca:
            fields = {}
            ports.append((f"{ca} port {match.group(1)}", fields))
        elif fields is not None and ":" in stripped:
            key, value = stripped.split(":", 1)
            fields[key.strip()] = value.strip()
    found = [_port_finding(port, fields.get("State", "unknown"), fields.get("Physical state"), fields.get("Link layer"))
             for port, fields in ports]
    return [f for f in found if f]


_SYSFS_STATES = {"NOP": "Nop", "DOWN": "Down", "INIT": "Initializing", "ARMED": "Armed", "ACTIVE": "Active",
                 "ACTIVE_DEFER": "ActiveDefer"}


def sysfs_ib_findings(states: Mapping[str, str], link_layers: Mapping[str, str] | None = None,
                      phys_states: Mapping[str, str] | None = None) -> list[GpuFinding]:
    """The same from ``/sys/class/infiniband/<dev>/ports/<n>/{state,phys_state,link_layer}``, each
    keyed ``"<dev> port <n>"``: ``state`` reads ``4: ACTIVE`` or ``1: DOWN`` (the kernel's
    ib_port_state names), ``phys_state`` ``5: LinkUp``, ``link_layer`` ``InfiniBand``."""
    def name(value: str | None) -> str | None:
        return value.split(":", 1)[-1].strip() if value else None

    found = [_port_finding(port, _SYSFS_STATES.get(name(state) or "", name(state) or "unknown"),
                           name((phys_states or {}).get(port)), ((link_layers or {}).get(port) or "").strip() or None)
             for port, state in states.items()]
    return [f for f in found if f]


# -- the edge: run the commands --------------------------------------------------------------------

@dataclass(frozen=True)
class CommandOutput:
    """What one command gave: its stdout, or why not."""

    text: str | None
    note: str | None = None
    missing: bool = False
    """The program is not installed here."""
    timed_out: bool = False


def run_command(argv: list[str], run: Runner = subprocess.run) -> CommandOutput:
    """``argv``'s stdout, or a note saying why there is none; never raises."""
    shown = " ".join(argv)
    try:
        proc = run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return CommandOutput(None, f"{argv[0]} is not installed here", missing=True)
    except subprocess.TimeoutExpired:
        return CommandOutput(None, f"`{shown}` did not answer within {COMMAND_TIMEOUT_S:.0f} s", timed_out=True)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return CommandOutput(None, f"`{shown}` could not run ({exc})")
    if proc.returncode != 0:
        why = ((proc.stderr or "").strip().splitlines() or (proc.stdout or "").strip().splitlines() or ["no output"])[-1]
        return CommandOutput(None, f"`{shown}` failed (exit {proc.returncode}: {why[:200]})")
    return CommandOutput(proc.stdout or "")


def read_kernel_log(run: Runner = subprocess.run) -> tuple[str | None, str | None]:
    """This boot's kernel log and None, or None and why it is not readable here. ``journalctl``
    first: run by a user outside the adm/systemd-journal groups it answers with nothing (not an
    error), which counts as unreadable, since this boot's kernel log is never empty; then ``dmesg``,
    which kernel.dmesg_restrict=1 refuses to non-root users."""
    why = []
    for argv in (["journalctl", "-k", "-b", "--no-pager", "-q"], ["dmesg"]):
        out = run_command(argv, run)
        if out.text is not None and out.text.strip() and out.text.strip() != "-- No entries --":
            return out.text, None
        why.append(out.note or f"`{' '.join(argv)}` showed no kernel messages")
    return None, ("XID events not readable here (" + "; ".join(why) + "); run the check as root, or as a member "
                  "of the adm or systemd-journal group, to see them")


def _natural(path: Path) -> tuple[int, str]:
    """mlx5_2 before mlx5_10, port 2 before port 10."""
    return len(path.name), path.name


def _read_sysfs(sysfs: Path) -> tuple[list[GpuFinding], list[str]]:
    states: dict[str, str] = {}
    layers: dict[str, str] = {}
    physical: dict[str, str] = {}
    try:
        for device in sorted(sysfs.iterdir() if sysfs.is_dir() else [], key=_natural):
            ports = device / "ports"
            for port in sorted(ports.iterdir() if ports.is_dir() else [], key=_natural):
                key = f"{device.name} port {port.name}"
                states[key] = (port / "state").read_text()
                for name, table in (("link_layer", layers), ("phys_state", physical)):
                    if (port / name).is_file():
                        table[key] = (port / name).read_text()
    except OSError as exc:
        return [], [f"InfiniBand ports not readable in {sysfs} ({exc})"]
    return sysfs_ib_findings(states, layers, physical), []


def read_gpu_health(run: Runner = subprocess.run, sysfs: Path = Path("/sys/class/infiniband"),
                    kernel_log_reader: Callable[[Runner], tuple[str | None, str | None]] = read_kernel_log,
                    ) -> GpuHealth | None:
    """This node's GPU health, or None where ``nvidia-smi`` is not installed (no GPU node)."""
    smi = run_command(["nvidia-smi", "-q", "-x"], run)
    if smi.missing:
        return None
    findings: list[GpuFinding] = []
    notes: list[str] = []
    bus_ids: dict[str, str] = {}
    if smi.text is None:
        notes.append(f"GPU state not readable here: {smi.note}")
    else:
        try:
            findings += nvidia_smi_findings(smi.text)
            bus_ids = gpu_bus_ids(smi.text)
        except ValueError as exc:
            notes.append(str(exc))
    log, why = kernel_log_reader(run)
    if log is None:
        notes.append(why or "XID events not readable here")
    else:
        findings += xid_findings(log, bus_ids)
    nvlink = run_command(["nvidia-smi", "nvlink", "-s"], run)
    if nvlink.text is None:
        notes.append(f"NVLink state not readable here: {nvlink.note}")
    else:
        findings += nvlink_findings(nvlink.text, bus_ids)
    ibstat = run_command(["ibstat"], run)
    if ibstat.text is not None:
        findings += ibstat_findings(ibstat.text)
    else:  # not installed, or no InfiniBand device (ibstat then exits non-zero): sysfs says which ports exist
        if ibstat.timed_out:
            notes.append(ibstat.note)
        sysfs_found, sysfs_notes = _read_sysfs(sysfs)
        findings += sysfs_found
        notes += sysfs_notes
    return GpuHealth(tuple(findings), tuple(notes))


def main() -> int:
    """Print this machine's findings and notes; exit 1 when there is a finding."""
    health = read_gpu_health()
    if health is None:
        print("no nvidia-smi here: not a GPU node")
        return 0
    for line in health.lines(0, socket.gethostname()) or ["no GPU health finding"]:
        print(line)
    return 1 if health.findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
