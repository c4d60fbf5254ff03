"""GPU health (orchestration/node/gpu_health.py) on samples written from the documented formats
(tests/data/gpu_health/README.md): a healthy node gives no finding, each problem exactly its line
with its fix; the edge that runs the commands turns a missing, refused or stuck command into a
note, never an exception, and gives None where nvidia-smi is not installed."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import TEST_DATA
from orchestration.node import preflight
from orchestration.node.gpu_health import (COMMAND_TIMEOUT_S, GpuFinding, GpuHealth, gpu_bus_ids, ibstat_findings,
                                           nvidia_smi_findings, nvlink_findings, pci_key, read_gpu_health,
                                           read_kernel_log, sysfs_ib_findings, xid_findings)
from orchestration.node.wire import CheckRequest, NodeCheckRequest, NodeTarget

SAMPLES = TEST_DATA / "gpu_health"
RESET = "(nvidia-smi -r -i {}, as root, nothing running on it)"
GPU0 = "node 2 (g0034), GPU 0 (00000000:1B:00.0): "
ECC_FIX = f"reset the GPU {RESET.format(0)} or drain the node"
IB_DOWN = "InfiniBand port Down (physical state Polling); no link: check the cable and the switch port, or exclude the node"
SMI = ("nvidia-smi", "-q", "-x")
JOURNAL = ("journalctl", "-k", "-b", "--no-pager", "-q")
NVLINK = ("nvidia-smi", "nvlink", "-s")


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()


HEALTHY_SMI = sample("nvidia_smi_h200_healthy.xml")
UNHEALTHY_SMI = sample("nvidia_smi_h200_unhealthy.xml")


def lines(findings: list[GpuFinding] | tuple[GpuFinding, ...]) -> list[str]:
    return [f.line(2, "g0034") for f in findings]


def fake_run(outputs: dict[tuple[str, ...], object]):
    """A ``subprocess.run`` that answers each argv from ``outputs`` (stdout, ``(rc, stdout, stderr)`` or an exception to
    raise); an argv not there is a program not installed. It asserts that every command is run with the check's timeout."""
    calls: list[tuple[str, ...]] = []

    def run(argv, **kwargs):
        assert kwargs.get("timeout") == COMMAND_TIMEOUT_S, (argv, kwargs)
        calls.append(tuple(argv))
        out = outputs.get(tuple(argv))
        if out is None:
            raise FileNotFoundError(2, "No such file or directory", argv[0])
        if isinstance(out, BaseException):
            raise out
        rc, stdout, stderr = out if isinstance(out, tuple) else (0, out, "")
        return subprocess.CompletedProcess(argv, rc, stdout, stderr)

    run.calls = calls
    return run


# -- each sample: a healthy one shows nothing, an unhealthy one exactly its lines ------------------

@pytest.mark.parametrize("findings,name", [(nvidia_smi_findings, "nvidia_smi_h200_healthy.xml"),
                                           (nvlink_findings, "nvlink_h200_healthy.txt"), (ibstat_findings, "ibstat_healthy.txt")])
def test_a_healthy_sample_shows_no_finding(findings, name):
    if findings is ibstat_findings:  # every InfiniBand port active; a down Ethernet port (mlx5_9, unused) is no finding
        assert "State: Down" in sample(name)
    assert findings(sample(name)) == []


@pytest.mark.parametrize("findings,name,expected", [
    (nvidia_smi_findings, "nvidia_smi_h200_unhealthy.xml", [  # exactly its ECC, remap, recovery and memory problems
        f"{GPU0}2 uncorrected ECC errors since the driver loaded (volatile dram_uncorrectable 2); {ECC_FIX}",
        f"{GPU0}a row remap is pending (1 row remapped for uncorrectable errors); reset the GPU {RESET.format(0)} or "
        "reboot the node to apply it",
        f"{GPU0}the driver asks for a recovery action: Reset; stop its processes and reset it {RESET.format(0)}",
        "node 2 (g0034), GPU 1 (00000000:43:00.0): process 61234 (/usr/bin/python3) already runs on it, holding "
        "71234 MiB; stop process 61234 (/usr/bin/python3) or exclude the node",
        "node 2 (g0034), GPU 2 (00000000:52:00.0): 2048 MiB of its memory in use by no process visible here; find "
        "the holder on the host (another container: nvidia-smi there, or fuser -v /dev/nvidia*) or exclude the node"]),
    # Volta and older: ``ecc_errors/volatile/double_bit/total``, ``remapped_rows`` N/A, no
    # ``fb_memory_usage/reserved``; a double-bit error leaves its page pending retirement.
    (nvidia_smi_findings, "nvidia_smi_v100_older_layout.xml", [
        "node 2 (g0034), GPU 0 (00000000:06:00.0): 2 uncorrected ECC errors since the driver loaded (volatile "
        f"double_bit/total 2); reset the GPU {RESET.format(0)} or drain the node",
        "node 2 (g0034), GPU 0 (00000000:06:00.0): memory pages pending retirement (pending_blacklist, "
        f"pending_retirement: Yes); reload the driver to retire them: reset the GPU {RESET.format(0)} or reboot the node"]),
    # Xid events counted per GPU and code, with the last message and the fix
    (lambda text: xid_findings(text, gpu_bus_ids(UNHEALTHY_SMI)), "kernel_log_xid.txt", [
        f"{GPU0}Xid 94 logged 2 times since boot (last: Contained: SM (0x1). RST: No, D-RST: No); a contained ECC "
        f"error, the GPU recovered: reset it {RESET.format(0)} when idle",
        f"{GPU0}Xid 63 logged once since boot (last: Row Remapper: New row marked for remapping, reset gpu to "
        f"activate.); a row remap (page retirement before Ampere) was recorded: reset the GPU {RESET.format(0)} to apply it",
        "node 2 (g0034), GPU 1 (00000000:43:00.0): Xid 13 logged 2 times since boot (last: Graphics Exception: ESR "
        "0x524730=0x10000e 0x524734=0x20 0x524728=0x1f81fb60 0x52472c=0x1174); an application's error (NVIDIA's "
        "device plugin keeps the GPU in service): nothing to do unless it recurs with a program known to work",
        "node 2 (g0034), PCI 0000:9a:00 (a GPU nvidia-smi does not list now): Xid 79 logged once since boot (last: "
        "GPU has fallen off the bus.); the GPU fell off the bus: reboot the node; if it recurs, drain it (PCIe, "
        "power or board)"]),
    # an inactive NVLink link is down where the other GPUs have theirs up
    (lambda text: nvlink_findings(text, gpu_bus_ids(HEALTHY_SMI)), "nvlink_h200_link_down.txt", [
        "node 2 (g0034), GPU 1 (00000000:43:00.0): NVLink link 7 down (17 of 18 up; the best-linked GPU here has 18); "
        f"reset the GPU {RESET.format(1)}; if it stays down, drain the node (an NVLink or NVSwitch fault: nvidia-smi nvlink -e)"]),
    # an InfiniBand port not active, with the fix its physical state calls for
    (ibstat_findings, "ibstat_port_down.txt", [
        f"node 2 (g0034), mlx5_3 port 1: {IB_DOWN}",
        "node 2 (g0034), mlx5_6 port 1: InfiniBand port Initializing (physical state LinkUp); the link is up but no "
        "subnet manager configured the port: check that one runs (opensm or the switch's), or exclude the node"]),
], ids=["h200_unhealthy", "v100_older_layout", "xid", "nvlink_down", "ibstat_port_down"])
def test_a_sample_shows_exactly_its_problems_with_their_fixes(findings, name, expected):
    assert lines(findings(sample(name))) == expected


# -- nvidia-smi -q -x ------------------------------------------------------------------------------

@pytest.mark.parametrize("old,new,expected", [
    # the SRAM counters of each newer layout count as uncorrected
    ("<sram_uncorrectable_parity>0</sram_uncorrectable_parity>", "<sram_uncorrectable_parity>1</sram_uncorrectable_parity>",
     [f"{GPU0}1 uncorrected ECC error since the driver loaded (volatile sram_uncorrectable_parity 1); {ECC_FIX}"]),
    ("<sram_uncorrectable_parity>0</sram_uncorrectable_parity>\n\t\t\t\t<sram_uncorrectable_secded>0</sram_uncorrectable_secded>",
     "<sram_uncorrectable>3</sram_uncorrectable>",
     [f"{GPU0}3 uncorrected ECC errors since the driver loaded (volatile sram_uncorrectable 3); {ECC_FIX}"]),
    # memory in use counts only above a GiB
    ("<used>0 MiB</used>", "<used>900 MiB</used>", []),
    ("<used>0 MiB</used>", "<used>1025 MiB</used>", [f"{GPU0}1025 MiB of its memory in use by no process visible here; find the "
                                                    "holder on the host (another container: nvidia-smi there, or fuser -v /dev/nvidia*) or "
                                                    "exclude the node"]),
    # a row remap failure asks for the GPU to be replaced
    ("<remapped_row_failure>No", "<remapped_row_failure>Yes", [f"{GPU0}a row remap has failed (the GPU is out of spare rows or could "
                                                               "not remap); drain the node and have the GPU replaced (NVIDIA's RMA "
                                                               "policy for row remapping)"]),
], ids=["sram_parity", "sram_v11", "memory_900_mib", "memory_1025_mib", "row_remap_failure"])
def test_one_value_changed_in_a_healthy_h200_is_exactly_its_finding(old, new, expected):
    assert old in HEALTHY_SMI
    assert lines(nvidia_smi_findings(HEALTHY_SMI.replace(old, new, 1))) == expected


def test_values_a_gpu_does_not_report_are_no_finding():
    """ECC off or unsupported: every counter N/A; no row remapper: ``remapped_rows`` N/A."""
    text = HEALTHY_SMI
    for tag in ("sram_uncorrectable_parity", "sram_uncorrectable_secded", "dram_uncorrectable", "used"):
        text = text.replace(f"<{tag}>0", f"<{tag}>N/A")
    text = text.replace("<current_ecc>Enabled</current_ecc>", "<current_ecc>Disabled</current_ecc>")
    text = text.replace("<gpu_recovery_action>None</gpu_recovery_action>", "<gpu_recovery_action>N/A</gpu_recovery_action>")
    assert "<dram_uncorrectable>N/A</dram_uncorrectable>" in text
    assert nvidia_smi_findings(text) == []


def test_output_that_is_not_xml_is_a_value_error():
    with pytest.raises(ValueError, match="nvidia-smi -q -x gave no XML"):
        nvidia_smi_findings("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_the_bus_ids_name_each_gpu_by_its_nvidia_smi_index():
    assert gpu_bus_ids(UNHEALTHY_SMI) == {"00000000:1B:00.0": "0", "00000000:43:00.0": "1", "00000000:52:00.0": "2"}


# -- Xid events ------------------------------------------------------------------------------------

def test_xid_addresses_match_the_gpu_whatever_their_spelling():
    """dmesg's and older drivers' spellings (no ``PCI:``, upper case, a MIG instance) name the same
    GPU as nvidia-smi's eight-digit domain with a function."""
    assert pci_key("00000000:1B:00.0") == pci_key("0000:1b:00") == pci_key("PCI:0000:1B:00") == (0, 0x1B, 0)
    log = ("[  812.214301] NVRM: Xid (0000:1B:00): 48, An uncorrectable double bit error (DBE) has been detected\n"
           "[  812.330112] NVRM: Xid (PCI:0000:1b:00 GPU-I:05): 95, pid=7194, name=python3, Uncontained: FBHUB. "
           "RST: Yes, D-RST: No\n"
           "[  900.000001] NVRM: Xid (PCI:0000:1b:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (Reset)\n")
    assert [f.gpu for f in xid_findings(log.replace("1B:00", "9A:00").replace("1b:00", "9a:00"), {})] == [
        "PCI 0000:9a:00 (a GPU nvidia-smi does not list now)"] * 3
    found = xid_findings(log, {"00000000:1B:00.0": "0"})
    assert [(f.gpu, f.what.split(" (last")[0]) for f in found] == [
        ("GPU 0 (00000000:1B:00.0)", f"Xid {code} logged once since boot") for code in (48, 95, 154)]
    assert found[1].what.endswith("(last: Uncontained: FBHUB. RST: Yes, D-RST: No)")
    assert found[2].fix == f"look up Xid 154 in NVIDIA's Xid catalog; reset the GPU {RESET.format(0)} or drain the node if it recurs"


def test_a_kernel_log_without_xid_events_gives_nothing():
    quiet = "\n".join(line for line in sample("kernel_log_xid.txt").splitlines() if "NVRM: Xid" not in line)
    assert "SXid" in quiet and "NVRM: GPU at PCI:0000:1b:00" in quiet
    assert xid_findings(quiet, gpu_bus_ids(UNHEALTHY_SMI)) == []


# -- NVLink ----------------------------------------------------------------------------------------

def test_a_gpu_whose_links_are_all_inactive_among_linked_peers_is_found():
    assert [f.gpu for f in nvlink_findings(sample("nvlink_h200_link_down.txt"))] == ["GPU 1"]  # without bus ids: the index
    text = sample("nvlink_h200_healthy.txt").splitlines()
    gpu5 = text.index(next(line for line in text if line.startswith("GPU 5:")))
    text[gpu5 + 1:gpu5 + 19] = [f"\t Link {n}: <inactive>" for n in range(18)]
    found = nvlink_findings("\n".join(text))
    assert [(f.gpu, f.what) for f in found] == [
        ("GPU 5", f"NVLink links {', '.join(str(n) for n in range(18))} down (0 of 18 up; the best-linked GPU here has 18)")]
    del text[gpu5 + 1:gpu5 + 19]  # GPU 5 listed with no link at all
    assert [f.what for f in nvlink_findings("\n".join(text))] == [
        "no NVLink link listed (0 of 0 up; the best-linked GPU here has 18)"]


def test_a_node_without_nvlink_has_no_nvlink_finding():
    """PCIe GPUs: nvidia-smi lists each GPU with no link, or every link inactive."""
    headers_only = ("GPU 0: NVIDIA L40S (UUID: GPU-0a1b2c3d-4e5f-4a6b-8c7d-8e9f0a1b2c01)\n"
                    "GPU 1: NVIDIA L40S (UUID: GPU-1b2c3d4e-5f6a-4b7c-9d8e-9f0a1b2c3d02)\n")
    all_inactive = "".join(f"GPU {g}: NVIDIA H100 PCIe (UUID: GPU-{g})\n" + "".join(f"\t Link {n}: <inactive>\n" for n in range(6))
                           for g in range(2))
    assert nvlink_findings(headers_only) == [] and nvlink_findings(all_inactive) == [] and nvlink_findings("") == []


# -- InfiniBand ------------------------------------------------------------------------------------

def _sysfs_files() -> dict[str, str]:
    return dict(line.split("\t", 1) for line in sample("sysfs_infiniband_port_down.txt").splitlines())


def test_sysfs_port_states_are_judged_like_ibstat():
    files = _sysfs_files()
    table = {name: {path.split("/ports/")[0] + " port " + path.split("/")[2]: value
                    for path, value in files.items() if path.endswith("/" + name)}
             for name in ("state", "link_layer", "phys_state")}
    assert lines(sysfs_ib_findings(table["state"], table["link_layer"], table["phys_state"])) == [
        f"node 2 (g0034), mlx5_2 port 1: {IB_DOWN}"]
    assert [f.gpu for f in sysfs_ib_findings(table["state"])] == ["mlx5_2 port 1", "mlx5_4 port 1"]  # no layer known
    assert sysfs_ib_findings({"mlx5_0 port 1": "4: ACTIVE\n", "mlx5_1 port 1": "5: ACTIVE_DEFER\n"}) == []


# -- the edge --------------------------------------------------------------------------------------

def _node(smi="nvidia_smi_h200_healthy.xml", nvlink="nvlink_h200_healthy.txt", ibstat="ibstat_healthy.txt",
          journal=None) -> dict[tuple[str, ...], object]:
    outputs = {SMI: sample(smi), NVLINK: sample(nvlink), JOURNAL: journal or "Mar 14 01:02:11 g0034 kernel: Linux version 6.8.0\n"}
    if ibstat:
        outputs[("ibstat",)] = sample(ibstat)
    return outputs


def _health(tmp_path, outputs, sysfs="none") -> GpuHealth | None:
    """read_gpu_health answered by ``outputs``, its sysfs under ``tmp_path`` (none there by default)."""
    return read_gpu_health(run=fake_run(outputs), sysfs=tmp_path / sysfs)


def test_a_healthy_node_reads_as_no_finding_and_no_note(tmp_path):
    run = fake_run(_node())
    assert read_gpu_health(run=run, sysfs=tmp_path / "none") == GpuHealth((), ())
    assert run.calls == [SMI, JOURNAL, NVLINK, ("ibstat",)]


def test_an_unhealthy_node_reads_as_every_finding_of_every_source(tmp_path):
    run = fake_run(_node(smi="nvidia_smi_h200_unhealthy.xml", nvlink="nvlink_h200_link_down.txt",
                         ibstat="ibstat_port_down.txt", journal=sample("kernel_log_xid.txt")))
    health, bus_ids = read_gpu_health(run=run, sysfs=tmp_path / "none"), gpu_bus_ids(UNHEALTHY_SMI)
    assert health.notes == ()
    assert health.findings == (*nvidia_smi_findings(UNHEALTHY_SMI),
                               *xid_findings(sample("kernel_log_xid.txt"), bus_ids),
                               *nvlink_findings(sample("nvlink_h200_link_down.txt"), bus_ids),
                               *ibstat_findings(sample("ibstat_port_down.txt")))
    assert len(health.findings) == 5 + 4 + 1 + 2
    assert health.lines(2, "g0034")[-1].startswith("node 2 (g0034), mlx5_6 port 1: InfiniBand port Initializing")


def test_without_ibstat_the_ports_are_read_from_sysfs(tmp_path):
    for path, value in _sysfs_files().items():
        (tmp_path / "sys" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sys" / path).write_text(value + "\n")
    health = _health(tmp_path, _node(ibstat=None), "sys")
    assert lines(health.findings) == [f"node 2 (g0034), mlx5_2 port 1: {IB_DOWN}"]
    assert health.notes == ()


def test_a_node_without_nvidia_smi_is_not_a_gpu_node(tmp_path):
    assert _health(tmp_path, {}, ".") is None


def test_a_command_that_times_out_is_a_note_not_an_exception(tmp_path):
    outputs = {**_node(), NVLINK: subprocess.TimeoutExpired(list(NVLINK), COMMAND_TIMEOUT_S),
               ("ibstat",): subprocess.TimeoutExpired(["ibstat"], COMMAND_TIMEOUT_S)}
    health = _health(tmp_path, outputs)
    assert health.findings == ()
    assert health.notes == ("NVLink state not readable here: `nvidia-smi nvlink -s` did not answer within 20 s",
                            "`ibstat` did not answer within 20 s")
    outputs[SMI] = subprocess.TimeoutExpired(list(SMI), COMMAND_TIMEOUT_S)
    assert _health(tmp_path, outputs).notes[0] == "GPU state not readable here: `nvidia-smi -q -x` did not answer within 20 s"


def test_nvidia_smi_failing_or_garbled_is_a_note(tmp_path):
    outputs = {**_node(), SMI: (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
                                   "that the latest NVIDIA driver is installed and running.\n", "")}
    assert _health(tmp_path, outputs).notes == ("GPU state not readable here: `nvidia-smi -q -x` failed (exit 9: NVIDIA-SMI has failed "
                            "because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA "
                            "driver is installed and running.)",)
    outputs[SMI] = "<nvidia_smi_log><gpu id="
    assert _health(tmp_path, outputs).notes[0].startswith("nvidia-smi -q -x gave no XML this check can read")


def test_an_unreadable_kernel_log_is_a_note_that_says_why_and_what_to_do():
    """journalctl for a user outside adm/systemd-journal prints no kernel line and exits 0; dmesg
    under kernel.dmesg_restrict=1 fails."""
    run = fake_run({JOURNAL: "", ("dmesg",): (1, "", "dmesg: read kernel buffer failed: Operation not permitted\n")})
    assert read_kernel_log(run) == (None, (
        "XID events not readable here (`journalctl -k -b --no-pager -q` showed no kernel messages; `dmesg` failed "
        "(exit 1: dmesg: read kernel buffer failed: Operation not permitted)); run the check as root, or as a member "
        "of the adm or systemd-journal group, to see them"))
    assert read_kernel_log(fake_run({("dmesg",): "[    0.000000] Linux version 6.8.0\n"})) == (
        "[    0.000000] Linux version 6.8.0\n", None)


def test_the_unreadable_kernel_log_note_reaches_the_node_report(tmp_path):
    health = _health(tmp_path, {**_node(), JOURNAL: (1, "", "No journal files were found.\n")})
    assert health.findings == ()
    assert health.lines(2, "g0034") == [
        "node 2 (g0034): XID events not readable here (`journalctl -k -b --no-pager -q` failed (exit 1: No journal files "
        "were found.); dmesg is not installed here); run the check as root, or as a member of the adm or "
        "systemd-journal group, to see them"]


def test_a_gpu_nodes_preflight_lists_each_finding_as_its_problem(tmp_path, monkeypatch):
    """inspect_node on a node that shows 2 GPUs, nvidia-smi on PATH answering with the unhealthy
    sample (a program, as the real one is run): each finding is one problem of the node's table,
    with its fix; a node without nvidia-smi (this machine) gets none."""
    request = NodeCheckRequest(NodeTarget("r", 0, "localhost", tmp_path), CheckRequest(master_addr="localhost", nproc_per_node=2, nnodes=1))
    bare = preflight.inspect_node(request, tmp_path / "rs", 2, tmp_path)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f'#!/bin/sh\ncase "$1" in -q) cat {SAMPLES / "nvidia_smi_h200_unhealthy.xml"};; '
                   f'nvlink) cat {SAMPLES / "nvlink_h200_healthy.txt"};; esac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(smi.parent), prepend=os.pathsep)
    sick = preflight.inspect_node(request, tmp_path / "rs", 2, tmp_path)
    expected = [f"{f.gpu}: {f.what}; {f.fix}" for f in nvidia_smi_findings(UNHEALTHY_SMI)]
    assert expected and [p for p in sick.problems if p not in bare.problems] == expected, sick.problems
