"""Real nodes beside kwok: a kubelet, a containerd (with runc) and a CNI bridge per node.

`RealNodes(plane, count)` joins ``count`` real nodes to a running `ControlPlane`. Each runs
real containers from images loaded into its containerd (no registry is reachable, see
images.py) and is registered with its own credentials (``system:node:<name>``, checked by
the Node authorizer and NodeRestriction). Real nodes carry the taint `REAL_NODE_TAINT`, so
only pods that tolerate it land on them; every other test keeps using kwok's nodes.

What it changes on the host, and restores on `stop()`:

- one bridge per node (``krdzv<i>``, gateway ``10.244.<10+i>.1``, optionally an IPv6
  ``fd10:244:<10+i>::1``) that the CNI bridge plugin attaches the node's pods to, and the
  bridge ``krdzv-svc`` holding the `kubernetes` Service's ClusterIP, where
  serviceproxy.py forwards port 443 to the API server;
- ``net.ipv4.ip_forward`` (and IPv6 forwarding with IPv6 pods), which pods on different
  nodes need: saved before, written back after;
- a cgroup per node (``k8srdzv-<node>``) in every cgroup hierarchy;
- mounts under the work directory only (the kubelet's root, made rshared so the volumes
  it mounts reach containerd; containerd's rootfs and netns mounts), and containerd's shim
  sockets in ``/run/krdzv-<pid>`` (their path may not exceed 42 characters).

A run that died without `stop()` (SIGKILLed) is cleaned up by the next `start()`, from
the state it saved (`stop_abandoned`).

The kubelet writes kernel settings (``vm.overcommit_memory``, ``kernel.panic``...)
globally; it runs in a mount namespace of its own where files holding the values it wants
are bind-mounted over those /proc/sys entries, so the host's stay as they were.

Pods get routes to the pod and Service ranges only, never a default route: their traffic
stays between this host and the pods' own network namespaces.

Every process (containerd, kubelet, the service proxy) is started with a parent-death
signal and stopped by its recorded PID; containers that outlive their kubelet (a test
stopped it) are killed by the PIDs their cgroups list.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from devkit.cluster.controlplane import (
    CLUSTER_DIR,
    ControlPlane,
    ControlPlaneError,
    dig,
    pid_alive,
    read_object,
    read_object_or_none,
    run_build_script,
)
from devkit.cluster.images import ImageArchive
from devkit.cluster.pki import CertPair, sign_certificate
from devkit.waiting import wait_for

REAL_NODE_LABEL = "k8s-rendezvous.dev/real-node"
REAL_NODE_TAINT = {"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}
REAL_NODE_TOLERATION = {"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
SERVICE_BRIDGE = "krdzv-svc"
KUBERNETES_SERVICE_IP = "10.0.0.1"  # the first address of controlplane.SERVICE_CIDR
POD_RANGE_V4 = "10.244.0.0/16"
POD_RANGE_V6 = "fd10:244::/32"  # holds every node's fd10:244:<n>::/64
SERVICE_RANGE_V4 = "10.0.0.0/24"
CGROUP_ROOT = Path("/sys/fs/cgroup")
CNI_CACHE = Path("/var/lib/cni")  # libcni's cache; containerd does not move it per node
KUBELET_PORT = 10250
STATE_FILE = "state.json"
STOP_GRACE_SECONDS = 10.0
# What the kubelet would write to /proc/sys when protectKernelDefaults is off; its own
# mount namespace gets a file per entry, so these never reach the host.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
FORWARDING_V4 = Path("/proc/sys/net/ipv4/ip_forward")
FORWARDING_V6 = Path("/proc/sys/net/ipv6/conf/all/forwarding")


class NodeError(ControlPlaneError):
    """A real node could not be set up, started or stopped."""


def _run(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def build_node_binaries() -> Path:
    """devkit/cluster/build.sh nodes: kubelet, containerd, runc, CNI plugins, pause."""
    return run_build_script(CLUSTER_DIR / "build.sh", "nodes")


@dataclass
class Daemon:
    """One long-running process, in its own session, stopped by its PID: SIGTERM, then
    SIGKILL after a grace period. Unless ``detach``, it gets a parent-death signal, so a
    SIGKILLed test run leaves none behind. ``executable`` is what the PID runs in the end
    (a wrapper may exec it): a recorded PID counts only while it still runs that."""

    name: str
    args: list[str]
    log: Path
    executable: Path
    env: dict[str, str] | None = None
    detach: bool = False
    pid: int | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        if self.running:
            raise NodeError(f"{self.name} is already running (pid {self.pid})")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        wrapper = [] if self.detach else ["setpriv", "--pdeathsig", "TERM"]
        with self.log.open("ab") as log:
            log.write(f"\n==== starting: {' '.join(self.args)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                [*wrapper, *self.args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self.pid = self._proc.pid

    @property
    def running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return self.pid is not None and _runs(self.pid, self.executable)

    def _signal_and_wait(self, signum: int, timeout: float) -> bool:
        if self.pid is None or not self.running:
            return True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.running

    def kill(self) -> None:
        """SIGKILL, as a crash would end it."""
        self._signal_and_wait(signal.SIGKILL, STOP_GRACE_SECONDS)

    def stop(self) -> None:
        if not self._signal_and_wait(signal.SIGTERM, STOP_GRACE_SECONDS):
            self.kill()
        self._proc = None
        self.pid = None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"<no log: {exc}>"


def _runs(pid: int, executable: Path) -> bool:
    """Whether ``pid`` is alive (not a zombie) and runs ``executable`` (no PID reuse)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
            return False
        return os.readlink(f"/proc/{pid}/exe") == str(executable)
    except OSError:
        return False


@dataclass
class RealNode:
    """One real node: its names, addresses, files and processes."""

    index: int
    directory: Path
    ipv6: bool
    """Dual-stack pods, IPv6 first; IPv4 only otherwise."""
    containerd: Daemon | None = None
    kubelet: Daemon | None = None
    images: list[ImageArchive] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"real-node-{self.index}"

    @property
    def bridge(self) -> str:
        return f"krdzv{self.index}"

    @property
    def subnet_v4(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.244.{10 + self.index}.0/24")

    @property
    def subnet_v6(self) -> ipaddress.IPv6Network:
        return ipaddress.IPv6Network(f"fd10:244:{10 + self.index}::/64")

    @property
    def address_v4(self) -> str:
        return str(self.subnet_v4.network_address + 1)

    @property
    def address_v6(self) -> str:
        return str(self.subnet_v6.network_address + 1)

    @property
    def addresses(self) -> list[str]:
        """The node's InternalIPs, first one first: its bridge's gateway addresses."""
        return [self.address_v6, self.address_v4] if self.ipv6 else [self.address_v4]

    @property
    def address(self) -> str:
        """The node's first InternalIP, where its kubelet listens."""
        return self.addresses[0]

    @property
    def cgroup(self) -> str:
        return f"k8srdzv-{self.name}"

    @property
    def socket(self) -> Path:
        return self.directory / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.directory / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.directory / "pod-logs"

    def cgroup_dirs(self) -> list[Path]:
        """This node's cgroup in every mounted hierarchy (cgroup v1 controllers, and the
        cgroup2 tree if mounted)."""
        return [
            hierarchy / self.cgroup
            for hierarchy in sorted(CGROUP_ROOT.iterdir())
            if (hierarchy / "cgroup.procs").exists()
        ]


class RealNodes:
    """``count`` real nodes joined to ``plane``; `start()` returns once all are Ready."""

    def __init__(
        self,
        plane: ControlPlane,
        count: int = 2,
        *,
        images: Sequence[ImageArchive] = (),
        binaries: Path | None = None,
        ipv6: bool = False,
        restart_delay_cap: int | None = None,
    ) -> None:
        """``restart_delay_cap``: the longest the kubelets delay restarting a container that
        keeps crashing, in seconds (their ``crashLoopBackOff.maxContainerRestartPeriod``,
        1-300); the kubelet's own 300 if None."""
        self.plane = plane
        self.restart_delay_cap = restart_delay_cap
        self.binaries = binaries or build_node_binaries()
        self.directory = plane.workdir / "nodes"
        # With IPv6 every pod is dual-stack with its IPv6 address first (status.podIP, its
        # POD_IP): the kubelet lists first the family of its node's first address, which
        # is then IPv6. Every node alike: gloo connects a world's ranks only within one
        # address family ("ss1.ss_family == ss2.ss_family. 10 vs 2" otherwise).
        self.nodes = [RealNode(i, self.directory / f"real-node-{i}", ipv6) for i in range(count)]
        self.images = list(images)
        self.ipv6 = ipv6
        self.service_proxy: Daemon | None = None
        self._saved_sysctls: dict[Path, str] = {}
        self._made_interfaces: list[str] = []
        self._started = False
        # containerd refuses a shim socket directory longer than 42 characters.
        self.short_directory = Path(f"/run/krdzv-{os.getpid()}")

    @classmethod
    def attach(cls, plane: ControlPlane) -> RealNodes | None:
        """A handle on the real nodes a detached ``up`` started beside ``plane`` (from
        their saved state), or None if it started none. ``stop()`` on it stops them."""
        path = plane.workdir / "nodes" / STATE_FILE
        if not path.exists():
            return None
        state = json.loads(path.read_text())
        nodes = cls(
            plane,
            state["count"],
            binaries=Path(state["binaries"]),
            ipv6=state["ipv6"],
        )
        nodes.short_directory = Path(state["short_directory"])
        nodes._saved_sysctls = {Path(k): v for k, v in state["saved_sysctls"].items()}
        nodes._made_interfaces = list(state["made_interfaces"])
        for name, pid in state["pids"].items():
            daemon = nodes._daemon_named(name)
            if daemon is not None:
                daemon.pid = pid
        nodes._started = True
        return nodes

    def _daemons(self) -> dict[str, Daemon]:
        named = {"service-proxy": self.service_proxy}
        for node in self.nodes:
            named[f"{node.name}/containerd"] = node.containerd
            named[f"{node.name}/kubelet"] = node.kubelet
        return {name: daemon for name, daemon in named.items() if daemon is not None}

    def _daemon_named(self, name: str) -> Daemon | None:
        """The daemon ``name`` (as _daemons() names them), made with its command line."""
        if name == "service-proxy":
            self.service_proxy = self._service_proxy_daemon()
            return self.service_proxy
        node_name, _, what = name.partition("/")
        node = self.node(node_name)
        if what == "containerd":
            node.containerd = self._containerd_daemon(node)
            return node.containerd
        if what == "kubelet":
            node.kubelet = self._kubelet_daemon(node)
            return node.kubelet
        return None

    def _save_state(self) -> None:
        state = {
            "count": len(self.nodes),
            "ipv6": self.ipv6,
            "binaries": str(self.binaries),
            "short_directory": str(self.short_directory),
            "saved_sysctls": {str(k): v for k, v in self._saved_sysctls.items()},
            "made_interfaces": self._made_interfaces,
            "pids": {name: d.pid for name, d in self._daemons().items() if d.pid is not None},
            # The process that must stop them; none for a detached `up` (`down` does).
            "owner": None if self.plane.detach else os.getpid(),
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        temporary = self.directory / (STATE_FILE + ".tmp")
        temporary.write_text(json.dumps(state, indent=2) + "\n")
        temporary.replace(self.directory / STATE_FILE)

    def node(self, name: str) -> RealNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if os.geteuid() != 0:
            raise NodeError("real nodes need root (bridges, mounts, cgroups, containerd)")
        stop_abandoned()
        leftovers = _leftover_interfaces()
        if leftovers:
            raise NodeError(
                f"interfaces {leftovers} of another real-node cluster exist; stop it "
                "(python -m devkit.cluster down) or delete them with `ip link del`"
            )
        self._started = True
        try:
            self._prepare_host()
            for node in self.nodes:
                self._start_node(node)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Delete the nodes' pods, stop every process by PID, and undo every host change.
        Idempotent; safe after a partial start."""
        if not self._started:
            return
        errors: list[str] = []
        with contextlib.suppress(Exception):
            self._delete_pods()
        for node in self.nodes:
            for step in (self._stop_node_processes, self._clean_node):
                try:
                    step(node)
                except Exception as exc:
                    errors.append(f"{node.name}: {step.__name__}: {exc}")
        if self.service_proxy is not None:
            self.service_proxy.stop()
        for interface in reversed(self._made_interfaces):
            _run("ip", "link", "del", interface, check=False)
        self._made_interfaces.clear()
        for path, value in self._saved_sysctls.items():
            try:
                path.write_text(value)
            except OSError as exc:
                errors.append(f"restoring {path}: {exc}")
        self._saved_sysctls.clear()
        shutil.rmtree(self.short_directory, ignore_errors=True)
        (self.directory / STATE_FILE).unlink(missing_ok=True)
        self._started = False
        if errors:
            raise NodeError("stopping real nodes: " + "; ".join(errors))

    # -- faults and helpers for tests ---------------------------------------------------

    def kill_kubelet(self, name: str) -> None:
        """SIGKILL the node's kubelet: its containers keep running, its heartbeats stop."""
        kubelet = self.node(name).kubelet
        if kubelet is not None:
            kubelet.kill()

    def start_kubelet(self, name: str) -> None:
        node = self.node(name)
        assert node.kubelet is not None
        node.kubelet.start()
        self._wait_ready([node])

    def cut_network(self, name: str) -> None:
        """Take the node's bridge down: its pods reach nothing and nothing reaches them."""
        _run("ip", "link", "set", self.node(name).bridge, "down")

    def restore_network(self, name: str) -> None:
        _run("ip", "link", "set", self.node(name).bridge, "up")

    # -- host ---------------------------------------------------------------------------

    def _prepare_host(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.short_directory.mkdir(mode=0o700)
        forwarding = [FORWARDING_V4, FORWARDING_V6] if self.ipv6 else [FORWARDING_V4]
        for path in forwarding:
            self._saved_sysctls[path] = path.read_text()
            self._save_state()
            path.write_text("1\n")
        self._make_bridge(SERVICE_BRIDGE, [f"{KUBERNETES_SERVICE_IP}/32"])
        for node in self.nodes:
            addresses = [f"{node.address_v4}/{node.subnet_v4.prefixlen}"]
            if node.ipv6:
                addresses.append(f"{node.address_v6}/{node.subnet_v6.prefixlen}")
            self._make_bridge(node.bridge, addresses)
        self.service_proxy = self._service_proxy_daemon()
        self.service_proxy.start()
        self._save_state()
        wait_for(
            lambda: "forwarding" in self.service_proxy.tail() if self.service_proxy else False,
            30,
            "the service proxy to listen",
        )

    def _service_proxy_daemon(self) -> Daemon:
        return Daemon(
            "service-proxy",
            [
                sys.executable,
                "-m",
                "devkit.cluster.serviceproxy",
                f"{KUBERNETES_SERVICE_IP}:443",
                f"{self.plane.host}:{self.plane.port}",
            ],
            self.directory / "service-proxy.log",
            Path(os.path.realpath(sys.executable)),
            env={**os.environ, "PYTHONPATH": str(CLUSTER_DIR.parent.parent)},
            detach=self.plane.detach,
        )

    def _containerd_daemon(self, node: RealNode) -> Daemon:
        return Daemon(
            "containerd",
            [str(self.binaries / "containerd"), f"--config={node.directory / 'containerd.toml'}"],
            node.directory / "logs" / "containerd.log",
            self.binaries / "containerd",
            detach=self.plane.detach,
        )

    def _kubelet_daemon(self, node: RealNode) -> Daemon:
        return Daemon(
            "kubelet",
            self._kubelet_command(node),
            node.directory / "logs" / "kubelet.log",
            self.binaries / "kubelet",
            detach=self.plane.detach,
        )

    def _make_bridge(self, name: str, addresses: list[str]) -> None:
        _run("ip", "link", "add", name, "type", "bridge")
        self._made_interfaces.append(name)
        self._save_state()
        for address in addresses:
            extra = ["nodad"] if ":" in address else []
            _run("ip", "addr", "add", address, "dev", name, *extra)
        _run("ip", "link", "set", name, "up")

    # -- one node -----------------------------------------------------------------------

    def _start_node(self, node: RealNode) -> None:
        node.directory.mkdir(parents=True, exist_ok=True)
        for sub in ("cni/net.d", "cni/ipam", "cdi", "pod-logs", "kubelet", "sysctl", "pki"):
            (node.directory / sub).mkdir(parents=True, exist_ok=True)
        self._write_cni_config(node)
        (node.directory / "containerd.toml").write_text(self._containerd_config(node))
        node.containerd = self._containerd_daemon(node)
        node.containerd.start()
        self._save_state()
        wait_for(
            lambda: self._serving(node),
            60,
            f"containerd of {node.name} to serve at {node.socket}",
        )
        for image in self.images:
            self.load_image(node, image)
        for hierarchy in node.cgroup_dirs():
            hierarchy.mkdir(exist_ok=True)
        self._write_kubelet_files(node)
        # The kubelet's root is an rshared mount point, so that the volumes the kubelet
        # mounts in its own mount namespace appear where containerd (in the host's) looks.
        _run("mount", "--bind", str(node.kubelet_root), str(node.kubelet_root))
        _run("mount", "--make-rshared", str(node.kubelet_root))
        node.kubelet = self._kubelet_daemon(node)
        node.kubelet.start()
        self._save_state()

    def _serving(self, node: RealNode) -> bool:
        assert node.containerd is not None
        if not node.containerd.running:
            raise NodeError(
                f"containerd of {node.name} exited; its log ends with:\n{node.containerd.tail()}"
            )
        return self._ctr(node, "version", check=False).returncode == 0

    def load_image(self, node: RealNode, image: ImageArchive) -> None:
        self._ctr(node, "images", "import", "--platform", "linux/amd64", str(image.path))
        if image not in node.images:
            node.images.append(image)

    def _ctr(
        self, node: RealNode, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return _run(
            str(self.binaries / "ctr"),
            f"--address={node.socket}",
            "--namespace=k8s.io",
            *args,
            check=check,
        )

    def _write_cni_config(self, node: RealNode) -> None:
        ranges = [[{"subnet": str(node.subnet_v4), "gateway": node.address_v4}]]
        routes = [{"dst": POD_RANGE_V4}, {"dst": SERVICE_RANGE_V4}]
        if node.ipv6:
            ranges.append([{"subnet": str(node.subnet_v6), "gateway": node.address_v6}])
            routes.append({"dst": POD_RANGE_V6})
        config = {
            "cniVersion": "1.0.0",
            "name": f"krdzv-{node.name}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": node.bridge,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(node.directory / "cni" / "ipam"),
                        "ranges": ranges,
                        "routes": routes,
                    },
                },
                {"type": "loopback"},
            ],
        }
        path = node.directory / "cni" / "net.d" / "10-krdzv.conflist"
        path.write_text(json.dumps(config, indent=2) + "\n")

    def _containerd_config(self, node: RealNode) -> str:
        d = node.directory
        pause = next((image.reference for image in self.images if "/pause:" in image.reference), "")
        if not pause:
            raise NodeError("real nodes need a pause image among their images (images.pause_image)")
        disabled = [
            "io.containerd.nri.v1.nri",
            "io.containerd.snapshotter.v1.zfs",
            "io.containerd.snapshotter.v1.devmapper",
            "io.containerd.snapshotter.v1.blockfile",
            "io.containerd.snapshotter.v1.erofs",
            "io.containerd.differ.v1.erofs",
            "io.containerd.mount-handler.v1.erofs",
        ]
        return f"""version = 4
root = '{d / "containerd" / "root"}'
state = '{d / "containerd" / "state"}'
disabled_plugins = {json.dumps(disabled)}

[grpc]
  address = '{node.socket}'
[ttrpc]
  address = '{node.socket}.ttrpc'

[plugins]
  [plugins.'io.containerd.server.v1.grpc']
    address = '{node.socket}'
  [plugins.'io.containerd.server.v1.ttrpc']
    address = '{node.socket}.ttrpc'
  [plugins.'io.containerd.shim.v1.manager']
    socket_dir = '{self.short_directory / f"shim{node.index}"}'
  [plugins.'io.containerd.internal.v1.opt']
    path = '{d / "containerd" / "opt"}'
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{pause}'
  [plugins.'io.containerd.cri.v1.runtime']
    netns_mounts_under_state_dir = true
    # This VM withholds CAP_SYS_RESOURCE: a pause process may not lower its oom_score_adj.
    restrict_oom_score_adj = true
    cdi_spec_dirs = ['{d / "cdi"}']
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        runtime_path = '{self.binaries / "containerd-shim-runc-v2"}'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '{self.binaries / "runc"}'
          Root = '{d / "runc"}'
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{self.binaries / "cni"}']
      conf_dir = '{d / "cni" / "net.d"}'
      ip_pref = '{"ipv6" if node.ipv6 else "ipv4"}'
  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
    stream_server_port = '0'
"""

    def _write_kubelet_files(self, node: RealNode) -> None:
        d = node.directory
        pki = self.plane.pki
        ca = CertPair(pki.ca.cert, pki.ca.key)
        client = sign_certificate(
            d / "pki",
            ca,
            "kubelet-client",
            f"/O=system:nodes/CN=system:node:{node.name}",
            "extendedKeyUsage=clientAuth\n",
        )
        serving = sign_certificate(
            d / "pki",
            ca,
            "kubelet-serving",
            f"/O=system:nodes/CN=system:node:{node.name}",
            "extendedKeyUsage=serverAuth\nsubjectAltName="
            + ",".join([*(f"IP:{a}" for a in node.addresses), f"DNS:{node.name}"])
            + "\n",
        )
        self.plane.write_kubeconfig_for_user(
            d / "kubelet.kubeconfig",
            {"client-certificate": str(client.cert), "client-key": str(client.key)},
        )
        # No nameserver: pods resolve only what /etc/hosts holds (their own name), so no
        # query ever leaves them.
        (d / "resolv.conf").write_text("options ndots:1\n")
        config: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": node.address,
            "port": KUBELET_PORT,
            "readOnlyPort": 0,
            "healthzBindAddress": node.address,
            "healthzPort": 10248,
            "tlsCertFile": str(serving.cert),
            "tlsPrivateKeyFile": str(serving.key),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(pki.ca.cert)},
            },
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{node.socket}",
            "imageServiceEndpoint": f"unix://{node.socket}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{node.cgroup}",
            "cgroupsPerQOS": True,
            "enforceNodeAllocatable": ["pods"],
            "failCgroupV1": False,
            "failSwapOn": False,
            "makeIPTablesUtilChains": False,
            "protectKernelDefaults": False,
            # Per node: a kubelet garbage-collects pod log directories of pods it does not
            # know, including another node's.
            "podLogsDir": str(node.pod_logs),
            "resolvConf": str(d / "resolv.conf"),
            "clusterDomain": "cluster.local",
            "serializeImagePulls": False,
            "registerNode": True,
            "registerWithTaints": [REAL_NODE_TAINT],
            "maxPods": 30,
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "2%",
                "imagefs.available": "2%",
                "nodefs.inodesFree": "2%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "volumePluginDir": str(d / "volume-plugins"),
        }
        if self.restart_delay_cap is not None:
            config["crashLoopBackOff"] = {"maxContainerRestartPeriod": f"{self.restart_delay_cap}s"}
        (d / "kubelet.json").write_text(json.dumps(config, indent=2) + "\n")
        for entry in KUBELET_SYSCTLS:
            (d / "sysctl" / entry.replace("/", ".")).write_text(
                (Path("/proc/sys") / entry).read_text()
            )

    def _kubelet_command(self, node: RealNode) -> list[str]:
        d = node.directory
        binds = " && ".join(
            f"mount --bind {d / 'sysctl' / entry.replace('/', '.')} /proc/sys/{entry}"
            for entry in KUBELET_SYSCTLS
        )
        kubelet = [
            str(self.binaries / "kubelet"),
            f"--config={d / 'kubelet.json'}",
            f"--kubeconfig={d / 'kubelet.kubeconfig'}",
            f"--root-dir={node.kubelet_root}",
            f"--cert-dir={d / 'pki'}",
            f"--hostname-override={node.name}",
            f"--node-ip={','.join(node.addresses)}",
            f"--node-labels={REAL_NODE_LABEL}=true,topology.kubernetes.io/zone=real-zone-{node.index}",
        ]
        # unshare without --fork execs the shell, which execs the kubelet: one PID.
        # /proc is made private first, so the binds never propagate to the host.
        script = f"mount --make-rprivate /proc && {binds} && exec {' '.join(kubelet)}"
        return ["unshare", "--mount", "--propagation", "unchanged", "--", "sh", "-c", script]

    # -- readiness ----------------------------------------------------------------------

    def _wait_ready(self, nodes: Sequence[RealNode] | None = None) -> None:
        targets = list(nodes or self.nodes)
        with self.plane.api_client() as api:
            core = kubernetes.client.CoreV1Api(api)

            def ready() -> bool:
                for node in targets:
                    for daemon in (node.containerd, node.kubelet):
                        if daemon is not None and not daemon.running:
                            raise NodeError(
                                f"{daemon.name} of {node.name} exited; its log ends with:\n"
                                f"{daemon.tail()}"
                            )
                    body = read_object_or_none(core.read_node, node.name)
                    if body is None:
                        return False
                    conditions = dig(body, "status", "conditions", default=[])
                    if not any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                        return False
                return True

            wait_for(ready, 120, f"real nodes {[n.name for n in targets]} to be Ready")

    # -- teardown -----------------------------------------------------------------------

    def _delete_pods(self) -> None:
        """Delete every pod bound to a real node and let its kubelet tear it down (the
        CNI plugin releases its address and veth), for up to 30 s."""
        with self.plane.api_client() as api:
            core = kubernetes.client.CoreV1Api(api)
            names = {node.name for node in self.nodes}

            def pods() -> list[dict[str, Any]]:
                items = read_object(core.list_pod_for_all_namespaces)["items"]
                return [p for p in items if dig(p, "spec", "nodeName") in names]

            for pod in pods():
                with contextlib.suppress(ApiException):
                    core.delete_namespaced_pod(
                        pod["metadata"]["name"],
                        pod["metadata"]["namespace"],
                        grace_period_seconds=1,
                    )
            live = [n for n in self.nodes if n.kubelet is not None and n.kubelet.running]
            if live:
                with contextlib.suppress(AssertionError):
                    wait_for(lambda: not pods(), 30, "pods on real nodes to be gone")

    def _stop_node_processes(self, node: RealNode) -> None:
        if node.kubelet is not None:
            node.kubelet.stop()
        # Containers a stopped kubelet left behind: their PIDs from the node's cgroups.
        for _attempt in range(20):
            pids = _cgroup_pids(node)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        if node.containerd is not None:
            node.containerd.stop()
        # Shims are detached from containerd (they outlive it by design): ours are those
        # running our shim binary for our node's socket.
        for pid in _shim_pids(self.binaries / "containerd-shim-runc-v2", node.socket):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _clean_node(self, node: RealNode) -> None:
        for mount in _mounts_under(node.directory):
            _run("umount", "--lazy", str(mount), check=False)
        for hierarchy in node.cgroup_dirs():
            _remove_cgroup(hierarchy)
        network = f"krdzv-{node.name}"
        results = CNI_CACHE / "results"
        if results.is_dir():
            for entry in results.glob(f"{network}-*"):
                # The loopback plugin's result for the same sandbox goes with it.
                sandbox = entry.name.removeprefix(f"{network}-").rpartition("-")[0]
                (results / f"cni-loopback-{sandbox}-lo").unlink(missing_ok=True)
                entry.unlink(missing_ok=True)
        containers_logs = Path("/var/log/containers")
        if containers_logs.is_dir():
            for link in containers_logs.iterdir():
                with contextlib.suppress(OSError):
                    if link.is_symlink() and str(os.readlink(link)).startswith(str(node.pod_logs)):
                        link.unlink()


def stop_abandoned(root: Path | None = None) -> list[Path]:
    """Undo what real nodes of a run that died without stopping them (SIGKILLed, say)
    left on the host: their processes went with their parent, but not their bridges,
    sysctls, mounts and cgroups. Returns the work directories it cleaned."""
    cleaned: list[Path] = []
    for path in sorted((root or Path(tempfile.gettempdir())).glob(f"*/nodes/{STATE_FILE}")):
        try:
            state = json.loads(path.read_text())
            owner = state.get("owner")
            if owner is None or pid_alive(owner):
                continue  # a detached cluster (`down` stops it) or a live run
            if any(pid_alive(pid) for pid in state.get("pids", {}).values()):
                continue
            nodes = RealNodes.attach(ControlPlane.attach(path.parent.parent))
        except (OSError, ValueError, KeyError):
            continue
        if nodes is not None:
            with contextlib.suppress(NodeError):
                nodes.stop()
            cleaned.append(path.parent.parent)
    return cleaned


def _leftover_interfaces() -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [name for name in names if name.startswith("krdzv")]


def _cgroup_pids(node: RealNode) -> set[int]:
    pids: set[int] = set()
    for hierarchy in node.cgroup_dirs():
        if not hierarchy.is_dir():
            continue
        for procs in hierarchy.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids.update(int(line) for line in procs.read_text().split())
    return pids


def _remove_cgroup(path: Path) -> None:
    """rmdir a cgroup and its children, deepest first (a cgroup directory is removed with
    rmdir, never with its files)."""
    if not path.is_dir():
        return
    children = sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for child in [*children, path]:
        with contextlib.suppress(OSError):
            child.rmdir()


def _shim_pids(shim: Path, socket: Path) -> list[int]:
    found: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(proc / "exe") != str(shim):
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if str(socket).encode() in argv:
                found.append(int(proc.name))
    return found


def _mounts_under(directory: Path) -> list[Path]:
    """Mount points at or below ``directory``, deepest first."""
    prefix = str(directory.resolve())
    points: list[Path] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(Path(point))
    return sorted(points, key=lambda p: -len(p.parts))
