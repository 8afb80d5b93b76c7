"""Which RDMA NICs Mooncake uses (`--mooncake-protocol rdma`, `--mooncake-devices`), checked at start.

RDMA is chosen, never fallen back from: a service asked for `rdma` that finds no RDMA device, or not the
ones named, exits at start with a message naming the flag and what it found. Devices are what the kernel
lists under /sys/class/infiniband (RoCE and InfiniBand NICs alike; the container needs them mounted, as
the RDMA device plugin does); `auto` takes every one with an ACTIVE port.
"""

from __future__ import annotations

from pathlib import Path

SYSFS = Path("/sys/class/infiniband")
PROTOCOLS = ("tcp", "rdma")


def rdma_devices(sysfs: Path = SYSFS) -> dict[str, bool]:
    """RDMA device name → whether any of its ports is ACTIVE."""
    if not sysfs.is_dir():
        return {}
    found = {}
    for dev in sorted(sysfs.iterdir()):
        states = [p.read_text().strip() for p in (dev / "ports").glob("*/state")] if (dev / "ports").is_dir() else []
        found[dev.name] = any(s.endswith("ACTIVE") for s in states)
    return found


def mooncake_device_names(kv_transport: str, protocol: str, devices: str, sysfs: Path = SYSFS) -> str:
    """The NIC list Mooncake's initialize() takes ("" for its tcp protocol); ValueError naming the flag
    when rdma cannot be had as asked."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"--mooncake-protocol: expected one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if protocol == "tcp":
        return ""
    if kv_transport != "mooncake":
        raise ValueError(f"--mooncake-protocol rdma needs --kv-transport mooncake (got --kv-transport {kv_transport})")
    found = rdma_devices(sysfs)
    listing = ", ".join(f"{name} ({'active' if up else 'no active port'})" for name, up in found.items()) or "none"
    if devices.strip() in ("", "auto"):
        active = [name for name, up in found.items() if up]
        if not active:
            raise ValueError(f"--mooncake-protocol rdma: no RDMA device with an active port under {sysfs} "
                             f"(found: {listing}); use --mooncake-protocol tcp, or give the pod the RDMA device")
        return ",".join(active)
    wanted = [d.strip() for d in devices.split(",") if d.strip()]
    missing = [d for d in wanted if d not in found]
    if missing:
        raise ValueError(f"--mooncake-devices: {', '.join(missing)} not found under {sysfs} (found: {listing})")
    return ",".join(wanted)
