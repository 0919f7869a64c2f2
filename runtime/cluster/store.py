"""Where the ranks meet, and who they answer to (docs/cluster-security.md).

The rendezvous store: torch's ``TCPStore`` listens on every interface when it
makes its own socket, and anyone who reaches it can write keys the ranks
read. So rank 0 binds the socket itself, on the address ``STORE_ENV`` names
(``HOST:PORT``; the launcher gives loopback, a multi-node run names the
interface's address explicitly), and hands it to the store; the process
group is made on that store (``open_process_group``). Under a torchrun the
user started by hand without ``STORE_ENV`` on one node, rank 0 binds
loopback on a free port and tells the others the port through torchrun's own
store (a number, never an object). gloo's own connections go through the
interface ``GLOO_SOCKET_IFNAME`` names: loopback (``lo``) for a loopback
store unless the caller set one.

The home: ``HOME_ENV`` holds the launcher's ``PID:START`` (its start time in
clock ticks from /proc, so a recycled pid is not mistaken for it); a rank's
watchdog ends the rank, and removes the run's temporary folder, when that
process is gone (``home_alive``). Under torchrun the ranks are torchrun's
children, not the launcher's, so their parent pid alone cannot tell.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import Mapping, Optional

from ds4quant.errors import BadInputError

__all__ = ["STORE_ENV", "HOME_ENV", "IFACE_ENV", "home_token", "home_alive", "parse_address", "is_loopback",
           "open_process_group"]

STORE_ENV = "DS4Q_CLUSTER_STORE"
HOME_ENV = "DS4Q_CLUSTER_HOME"
IFACE_ENV = "DS4Q_CLUSTER_INTERFACE"
_PORT_KEY = "ds4quant/cluster-store-port"


def _start_ticks(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count fields after its last ')'
    rest = stat[stat.rfind(")") + 2:].split()
    return rest[19] if len(rest) > 19 else None


def home_token(pid: Optional[int] = None) -> str:
    """``PID:START`` of this process (or ``pid``), the value of ``HOME_ENV``."""
    pid = os.getpid() if pid is None else int(pid)
    return f"{pid}:{_start_ticks(pid) or '?'}"


def home_alive(token: str) -> bool:
    """Whether the process ``token`` (``home_token``) still runs."""
    pid_s, _, start = token.partition(":")
    try:
        pid = int(pid_s)
    except ValueError:
        return True  # not ours to judge; the parent-pid check still holds
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's: the start time decides
    now = _start_ticks(pid)
    if start != "?" and now is not None and now != start:
        return False  # the pid was recycled
    if now is not None:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().decode(errors="replace")
            if state[state.rfind(")") + 2:].split()[0] == "Z":
                return False  # exited, not yet reaped
        except OSError:
            return False
    return True


def parse_address(text: str, where: str = "--store-address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port)."""
    host, sep, port = str(text).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise BadInputError(f"must be HOST:PORT (the address rank 0 listens on), got {text!r}", where=where)
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _store_address(env: Mapping[str, str]) -> tuple[str, int, bool]:
    """(host, port, whether the port comes from torchrun's store)."""
    if env.get(STORE_ENV):
        host, port = parse_address(env[STORE_ENV], where=STORE_ENV)
        return host, port, False
    single = env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE")) == env.get("WORLD_SIZE")
    if not single:
        raise BadInputError("a cluster over several nodes needs the address rank 0's store listens on: "
                            "--store-address HOST:PORT (and --interface IFACE); docs/cluster-security.md says "
                            "what that exposes", where="cluster")
    if env.get("TORCHELASTIC_RUN_ID") and env.get("MASTER_PORT"):
        return "127.0.0.1", 0, True
    raise BadInputError(f"no {STORE_ENV}: start the ranks with ds4quant run or torchrun", where="cluster")


def open_process_group(backend: str, timeout_s: float, env: Optional[Mapping[str, str]] = None) -> None:
    """``init_process_group`` on a store rank 0 binds where ``_store_address`` says."""
    import torch.distributed as dist

    env = os.environ if env is None else env
    rank, n = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    host, port, via_torchrun = _store_address(env)
    if env.get(IFACE_ENV):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", env[IFACE_ENV])
        os.environ.setdefault("NCCL_SOCKET_IFNAME", env[IFACE_ENV])
    elif is_loopback(host):
        # one host: gloo's pair sockets and NCCL's bootstrap sockets stay on loopback too
        # (NCCL would pick the first other interface); NCCL's data goes over NVLink / PCIe
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    td = timedelta(seconds=timeout_s)
    if via_torchrun:
        agent = dist.TCPStore(env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]), is_master=False,
                              timeout=td)
    listener = None
    if rank == 0:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=fam, backlog=max(64, n))
        port = listener.getsockname()[1]
        store = dist.TCPStore(host, port, n, True, timeout=td, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
        if via_torchrun:
            agent.set(_PORT_KEY, str(port))
    else:
        if via_torchrun:
            port = int(agent.get(_PORT_KEY).decode())
        store = dist.TCPStore(host, port, n, False, timeout=td)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=n, timeout=td)
    _KEEP.append((store, listener))  # the store serves from the listener's fd: both live with the group


_KEEP: list = []
