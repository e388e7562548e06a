"""The Ray instance the replicas run on: joined, or started here and stopped with us.

Owns: importing Ray (the `ray` extra), and the life of a local Ray instance that this
process starts: its CPU count, its loopback-only address, no dashboard, its logs and
sockets in a temporary folder removed at the end.
Promises: `connect(None, cpus)` in a process where Ray already runs uses that instance
and leaves it running; otherwise it starts a local one with exactly `cpus` CPUs that
`close()` shuts down (every Ray process with it), on 127.0.0.1 only when Ray is first
imported by `import_ray(local=True)`;
`connect(address, ...)` joins an existing cluster and `close()` only disconnects.
Missing Ray, or a cluster that cannot be reached, is a `RayUnavailable` saying what to
do.
Never: starts replicas (`ReplicaSet` does).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from types import ModuleType

# Memory for Ray's object store on a local instance: replicas send token updates and
# results, never tensors, so the default (30% of RAM) would only be reserved for nothing.
LOCAL_OBJECT_STORE_BYTES = 512 * 2**20
# Without this, Ray resolves 127.0.0.1 to the machine's outward address and serves its
# local processes there; with it, a local instance stays on the loopback interface.
# Read when Ray is imported, so set before that, and only for a local instance.
_LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached."""


def import_ray(local: bool = False) -> ModuleType:
    if local and "ray" not in sys.modules:
        os.environ.setdefault(_LOOPBACK_ONLY, "0")
    try:
        import ray
    except ImportError as error:
        raise RayUnavailable(
            "replicas run on Ray, which is not installed: pip install 'cellbatch[ray]'"
        ) from error
    return ray


@dataclass
class RayCluster:
    ray: ModuleType
    address: str | None  # None: a local instance
    owned: bool  # this process started Ray (or connected to it) and ends that at close
    temp_dir: str | None = None

    def close(self) -> None:
        """Shut the local instance down (or disconnect); idempotent."""
        if self.owned and self.ray.is_initialized():
            self.ray.shutdown()
        self.owned = False
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def connect(address: str | None, cpus: int) -> RayCluster:
    """Ray for the replicas: the cluster at `address`, the instance this process already
    runs, or a new local one with `cpus` CPUs."""
    ray = import_ray(local=address is None)
    if ray.is_initialized():
        return RayCluster(ray, address, owned=False)
    if address is not None:
        try:
            ray.init(address=address, logging_level="warning")
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise RayUnavailable(
                f"cannot join the Ray cluster at {address}: {error}; check the address "
                "(its head node's host:port, or 'auto' on a node of the cluster)"
            ) from error
        return RayCluster(ray, address, owned=True)
    # A short path: Ray's socket names under it must stay within the 107 bytes of a
    # Unix socket address.
    temp_dir = tempfile.mkdtemp(prefix="cellbatch-ray-", dir="/tmp" if os.name == "posix" else None)
    try:
        ray.init(
            num_cpus=cpus,
            include_dashboard=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            logging_level="warning",
            _node_ip_address="127.0.0.1",
            _temp_dir=temp_dir,
        )
    except Exception:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return RayCluster(ray, None, owned=True, temp_dir=temp_dir)
