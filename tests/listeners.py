"""Listening TCP sockets of a set of processes, from ``/proc`` (no ``ss`` or ``lsof`` needed).

Listeners come from ``/proc/<pid>/net/tcp{,6}`` (the network namespace of that process) matched
to the socket inodes in ``/proc/<pid>/fd``. IPv4-mapped IPv6 addresses are reported as IPv4.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

WILDCARDS = {"0.0.0.0", "::"}


def _addr(hex_addr: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    # /proc/net/tcp{,6} prints each 32-bit word of the address in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped), int(port_hex, 16)
    return str(ip), int(port_hex, 16)


def listening_inodes(pid: int) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in ``pid``'s network namespace."""
    out: dict[int, tuple[str, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":  # TCP_LISTEN
                out[int(f[9])] = _addr(f[1])
    return out


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def process_name(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    args = [a.decode(errors="replace") for a in cmd if a]
    if not args:
        return "?"
    if args[0].startswith("ray::"):
        return args[0].split()[0]
    for a in args[:3]:
        base = os.path.basename(a)
        if base in ("gcs_server", "raylet"):
            return base
        if a.endswith(".py"):
            return base
        if a.startswith("ray.") or a == "-c":
            return a
    return os.path.basename(args[0])


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:
                continue
    return sorted(pids)


def listeners(pids: list[int], roles: dict[int, str] | None = None) -> list[dict]:
    """Every listening TCP socket of ``pids``: ``{pid, process, address, port}``."""
    roles = roles or {}
    found = []
    for pid in pids:
        table = listening_inodes(pid)
        for inode in sorted(socket_inodes(pid)):
            if inode in table:
                addr, port = table[inode]
                found.append({"pid": pid, "process": roles.get(pid) or process_name(pid), "address": addr,
                              "port": port})
    return found
