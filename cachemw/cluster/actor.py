"""Node daemons as Ray actors: one per node, named, detached, in namespace ``cachemw``.

Ray places, finds and restarts the daemons; the data plane is the node-local socket and
the tier files (see service.py), so trainers and DataLoader workers never touch Ray.

``start()`` without an address starts a private local Ray cluster with Ray's token
authentication on (the token in a 0600 file of the runtime dir): Ray listens on the
node's interfaces all the same (it takes a loopback node address for the node's own and
binds its servers to every interface), so the token is its guard. With an address it
joins the user's cluster as configured by the user's environment.
"""
from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from dataclasses import asdict

from ..config import DaemonConfig, daemon_environment, ray_address, resolve_runtime_dir
from ..config_values import format_size, parse_size
from ..launch import held_by_another_host, remove_checkpoint_copies, stop_local
from ..node.service import NodeService
from ..protocol import lock_holder, lookup
from . import local_ray
from .blockserver import BlockServer
from .names import NAMESPACE, actor_name
from .owner import RemoteReads, serve_blocks
from .peers import PeerSet, pack

log = logging.getLogger(__name__)

PEER_OPTIONS = ("peer_timeout", "refresh_interval", "replicate_after", "cluster_secret")
PEER_DEFAULTS = {"peer_timeout": 10.0, "refresh_interval": 2.0, "replicate_after": 2}


class DaemonActor:
    """The thin actor wrapper: a NodeService plus this node's view of its peers.

    Options are DaemonConfig.build keywords (string values may contain ``{node_id}``, so
    simulated nodes sharing one machine get their own directories) plus PEER_OPTIONS.
    """

    def __init__(self, options: dict) -> None:
        import ray


        logging.basicConfig(level=logging.INFO)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.options = dict(options)
        self.error = None
        self.service = self.peers = self.blocks = None
        opts = {k: (v.format(node_id=self.node_id) if isinstance(v, str) else v)
                for k, v in options.items() if k not in PEER_OPTIONS}
        try:  # a daemon that cannot start says why (start() reports it in one line)
            self.config = DaemonConfig.build(node_id=self.node_id, **opts)
            self.service = NodeService(self.config, kind="ray",
                                       host=ray.util.get_node_ip_address())
        except Exception as exc:  # any failure: the actor lives on to say why (address())
            self.error = str(exc) if isinstance(exc, (OSError, ValueError, RuntimeError)) \
                else f"{type(exc).__name__}: {exc}"
            log.error("cachemw daemon cannot start: %s", self.error)
            return
        secret = options.get("cluster_secret")
        self.blocks = None
        if secret:  # the data plane for remote hits (Ray remains the control plane)
            self.blocks = BlockServer(self.service.node, ray.util.get_node_ip_address(),
                                      bytes.fromhex(secret))
        self.peers = PeerSet(self.node_id, spawn=lambda n: place(n, self.options),
                             timeout=options.get("peer_timeout", PEER_DEFAULTS["peer_timeout"]),
                             refresh_interval=options.get("refresh_interval",
                                                          PEER_DEFAULTS["refresh_interval"]),
                             secret=secret, blocks=self.blocks.address if self.blocks else None)
        node = self.service.node
        node.remote = RemoteReads(node, self.peers,
                                  replicate_after=options.get(
                                      "replicate_after", PEER_DEFAULTS["replicate_after"]))
        self.peers.start()
        self.service.stats = self.stats  # the metrics endpoint exports the peers' counters too

    def address(self) -> dict:
        if self.error is not None:
            return {"node_id": self.node_id, "error": self.error}
        return dict(asdict(self.service.address),
                    blocks=list(self.blocks.address) if self.blocks else None)

    def settings(self) -> dict:
        """What this daemon runs with, in start()'s terms (to compare with a new start)."""
        if self.error is not None:
            return {}
        tiers = {t.name: t for t in self.config.tiers}
        out = {"dram_dir": tiers["dram"].path, "dram_capacity": tiers["dram"].capacity,
               "nvme_dir": tiers["nvme"].path if "nvme" in tiers else None,
               "nvme_capacity": tiers["nvme"].capacity if "nvme" in tiers else None,
               "placement": self.config.placement, "metrics_port": self.config.metrics_port,
               "trace_dir": self.config.trace_dir}
        out.update({k: self.options.get(k, default) for k, default in PEER_DEFAULTS.items()})
        return dict(out, node_id=self.node_id)

    def stats(self) -> dict:
        stats = self.service.node.stats()
        stats["peers"] = dict(self.peers.counters, ring=list(self.peers.members),
                              names=list(self.peers.ring.nodes))
        return stats

    def serve_blocks(self, requests: list[tuple]):
        """Blocks this node owns, for a peer: their lengths, then their bytes in pieces
        Ray sends inline (peers.pack; the caller asks for 1 + pieces_for(requests))."""
        return pack(serve_blocks(self.service.node, requests), requests)

    def ping(self) -> str:
        return self.node_id

    def stop(self) -> None:
        if self.peers is not None:
            self.peers.close()
        if self.blocks is not None:
            self.blocks.close()
        if self.service is not None:
            if self.service.node.remote is not None:
                self.service.node.remote.close()
            self.service.close()


def place(node_id: str, options: dict):
    """Create (or find) the daemon actor of ``node_id``, pinned to that node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_cls = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=16)(DaemonActor)
    return actor_cls.options(
        name=actor_name(node_id), namespace=NAMESPACE, lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(options)


def _ray():
    import ray

    return ray


def connect(address: str | None = None, runtime_dir: str | None = None, *,
            start_if_needed: bool = False) -> dict:
    """ray.init into the cluster: the given one, else the local one ``cachemw start`` made
    for ``runtime_dir`` (alive), else (``start_if_needed``) a new local one, else the one
    ``RAY_ADDRESS`` names. The local one comes first: its daemons are this runtime dir's,
    and a RAY_ADDRESS exported for other work must not send ``stop`` elsewhere. ``start``
    never reads RAY_ADDRESS: without ``--address`` it makes its private cluster, as said.
    An address given where nothing answers is UnreachableCluster at once (ray.init would
    retry for minutes, silent); one naming that local cluster is that cluster (own_address).

    Ray reads its auth settings when it is imported: set them before importing it.
    """
    runtime_dir = resolve_runtime_dir(runtime_dir)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # a driver already connected: use its cluster
        return _connected(ray, address, runtime_dir)
    address = own_address(address, runtime_dir)
    given = address  # --address, not the local cluster's nor RAY_ADDRESS's
    state = None
    if address is not None:
        _check_given(address, f"{address} (the address given)", "leave --address out",
                     UnreachableCluster)
    if address is None:
        state = local_ray.read_state(runtime_dir)
        if state is None or not local_ray.alive(state):
            state = None
            if start_if_needed:
                state = dict(local_ray.start(runtime_dir), started_now=True)
            else:
                address = ray_address()
                if address is None:
                    raise ConnectionError("no cachemw-managed Ray cluster runs; give --address "
                                          "(or set RAY_ADDRESS) or run `cachemw start`")
                _check_given(address, f"RAY_ADDRESS={address}", "unset it, or give --address",
                             ConnectionError)
    if state is not None:
        address = state["address"]
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = state["token_path"]
    ray = _ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING,
                     log_to_driver=False)
        except ConnectionError as exc:  # the cluster given refused us: the command's error
            if given is None:  # (stop, status, top went on as if no cluster ran, exit 0:
                raise  # review ops5), not "no cluster" (RAY_ADDRESS's: passed over)
            raise UnreachableCluster(
                f"cannot join the Ray cluster at {given}: {exc}; the address must be the "
                f"head's GCS (`ray start --head --port`, 6379 by default; not a raylet's "
                f"nor the client server's port), and a cluster with token auth (as "
                f"`cachemw start` makes) admits only a process with its token "
                f"(RAY_AUTH_MODE=token and RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)") from exc
    return state or {"address": address, "started_by_cachemw": False}


# How long an address given (--address, RAY_ADDRESS) may stay silent before it is refused:
# ray.init at a listener that accepts and never answers retried for minutes (5 at least,
# review ops6), where a GCS answers the probe within milliseconds, under load too.
GIVEN_PATIENCE_S = 10.0


def _check_given(address: str, where: str, advice: str, error: type) -> None:
    """Raise ``error`` unless Ray's GCS answers at ``address`` (``where`` for the message):
    ray.init at a port where nothing, another server, or a silent listener is would retry
    for minutes, saying nothing."""
    found = local_ray.probe(address, patience=GIVEN_PATIENCE_S)
    if found == "grpc":
        return
    what = {"none": "nothing accepts a connection there",
            "unanswered": f"nothing answered a connection within {GIVEN_PATIENCE_S:.0f} s",
            "other": "the server there is not Ray's (it does not speak gRPC)",
            "silent": f"a server accepts connections there but says nothing within "
                      f"{GIVEN_PATIENCE_S:.0f} s (a stopped or hung Ray head, or another "
                      f"kind of server)"}[found]
    raise error(f"no Ray cluster answers at {where}: {what}; check it, or {advice}")


def _connected(ray, address: str | None, runtime_dir: str) -> dict:
    """The cluster of a process already in Ray: the local one ``cachemw start`` made for
    ``runtime_dir`` (its record, so that ``stop`` stops it whole) when that is where the
    process is, as after ``cachemw.start()`` in it; else the driver's own. Taken for the
    driver's own, ``cachemw.start()`` then ``cachemw.stop()`` in one process stopped the
    daemon and left the private cluster's processes running (review readme8)."""
    state = local_ray.read_state(runtime_dir)
    if state is not None and (address is None or local_ray.names(state, address)):
        try:
            current = ray.get_runtime_context().gcs_address
        except Exception:  # noqa: BLE001 - not known: the driver's own, as before
            current = None
        if current and local_ray.names(state, current):
            return state
    return {"address": address or "current", "started_by_cachemw": False}


class UnreachableCluster(ConnectionError):
    """Nothing answers at the address given: the command's error (exit 2), not "no
    cluster", after which status and top would show this node's own daemon instead."""


def own_address(address: str | None, runtime_dir: str) -> str | None:
    """``address``, or None where it names the local cluster ``cachemw start`` made for
    ``runtime_dir`` (alive): reached as if no address were given, with its token (and
    ``stop`` stops it whole)."""
    if address is None:
        return None
    state = local_ray.read_state(runtime_dir)
    return None if local_ray.names(state, address) and local_ray.alive(state) else address


def start(address: str | None = None, *, runtime_dir: str | None = None, timeout: float = 120,
          **options) -> list[dict]:
    """Place one daemon on every alive Ray node (idempotent: existing ones are kept).

    ``options`` are DaemonConfig.build keywords (dram_dir, dram_capacity, nvme_dir,
    nvme_capacity, placement, ...) and PEER_OPTIONS; what they leave out, this process's
    CACHEMW_* variables give (config.daemon_environment), else each daemon's defaults on
    its own node; ``{node_id}`` in a string option becomes that node's id.
    """
    runtime_dir = resolve_runtime_dir(runtime_dir)
    DaemonConfig.build(runtime_dir=runtime_dir,  # fail early on bad options (and variables)
                       **{k: v for k, v in options.items() if k not in PEER_OPTIONS})
    options = dict(daemon_environment(), **options)  # not the actors' (their raylet's)
    timeout_option = options.get("peer_timeout")
    if timeout_option is not None and (isinstance(timeout_option, bool) or not isinstance(
            timeout_option, (int, float)) or not 0 < timeout_option < float("inf")):
        raise ValueError(f"peer_timeout: must be a number of seconds > 0, got {timeout_option!r}")
    holder = lock_holder(runtime_dir)
    if holder is not None and holder.get("kind") != "ray":
        raise RuntimeError(f"an autostarted cachemw daemon (pid {holder.get('pid')}) serves "
                           f"{runtime_dir}; stop it first (`cachemw stop`)")
    asked = dict(options)
    address = own_address(address, runtime_dir)
    state = connect(address, runtime_dir, start_if_needed=address is None)
    ray = _ray()
    try:
        shared = _shared_dirs(ray.nodes(), runtime_dir, options)
        if shared:
            raise ValueError(shared)
        running = set(_daemon_handles())
        # one secret for the cluster's block servers; a re-run keeps the running daemons' one
        options.setdefault("cluster_secret", secrets.token_hex(32))
        handles = {}
        for node in ray.nodes():
            if node.get("Alive"):
                handles[node["NodeID"]] = place(node["NodeID"],
                                                dict(options, runtime_dir=runtime_dir))
        refs = {node_id: h.address.remote() for node_id, h in handles.items()}
        out = [ray.get(ref, timeout=timeout) for ref in refs.values()]
        failed = [a for a in out if "error" in a]
        if failed:
            for a in failed:
                ray.kill(handles[a["node_id"]], no_restart=True)
            raise RuntimeError("; ".join(f"the daemon on node {a['node_id'][:12]} cannot "
                                         f"start: {a['error']}" for a in failed))
        differences = []
        for node_id in running & set(handles):
            have = ray.get(handles[node_id].settings.remote(), timeout=timeout)
            differences += [f"node {node_id[:12]}: {d}" for d in _differences(asked, have)]
        if differences:
            raise RuntimeError("cachemw daemons already run with other settings ("
                               + "; ".join(differences) + "); to change them, stop them "
                               "first (`cachemw stop`), then start again")
    except BaseException:  # a failed or interrupted start leaves no Ray it started; re-raised
        if state.get("started_now"):  # nothing of a failed start is left running
            ray.shutdown()
            local_ray.stop(state["temp_dir"], state.get("strays"))
            local_ray.forget_state(runtime_dir)
        raise
    return out


def _shared_dirs(nodes: list[dict], runtime_dir: str, options: dict) -> str | None:
    """Why these daemons cannot start, when several alive Ray nodes share one host (a
    ``ray.cluster_utils.Cluster``, several raylets per machine) and a directory they would
    all use does not name the node: each daemon locks its runtime dir, so all but one would
    die in their actor's creation task. Checked before any daemon is placed."""
    by_host: dict[str, list[str]] = {}
    for node in nodes:
        if node.get("Alive"):
            by_host.setdefault(node.get("NodeManagerAddress", "?"), []).append(node["NodeID"])
    host, ids = max(by_host.items(), key=lambda kv: len(kv[1]), default=("", []))
    if len(ids) < 2:
        return None
    dirs = {"runtime_dir": runtime_dir, "dram_dir": options.get("dram_dir"),
            "nvme_dir": options.get("nvme_dir")}
    clash = {k: v for k, v in dirs.items() if v and "{node_id" not in str(v)}
    port = options.get("metrics_port")
    if not clash and port:
        return (f"{len(ids)} Ray nodes share host {host}, and their daemons would all serve "
                f"metrics on port {port}; use metrics_port=0 (--metrics-port 0: any free "
                f"port each, listed by `cachemw status`)")
    if not clash:
        return None
    fixes = ", ".join(f"{k}={os.path.join(str(v), '{node_id:.16}')!r}" for k, v in clash.items())
    return (f"{len(ids)} Ray nodes share host {host}, and their daemons would share "
            + ", ".join(f"{k} {v!r}" for k, v in clash.items())
            + f"; give each node its own with {{node_id}} in the path, e.g. {fixes} "
            f"(CLI: `cachemw --runtime-dir DIR start --dram-dir DIR --nvme-dir DIR`, or "
            f"CACHEMW_RUNTIME_DIR, CACHEMW_DRAM_DIR, CACHEMW_NVME_DIR)")


def _differences(asked: dict, have: dict) -> list[str]:
    """The settings a running daemon (``have``: DaemonActor.settings) has other than those
    asked for; an option not asked for is whatever runs."""
    out = []
    for key, value in asked.items():
        if key not in have or value is None:
            continue
        current = have[key]
        if key.endswith("_dir"):
            value = os.path.abspath(str(value).format(node_id=have["node_id"]))
            current = os.path.abspath(current) if current else current
        elif key.endswith("_capacity"):
            value = parse_size(value, name=key)
        if value != current:
            show = format_size if key.endswith("_capacity") else repr
            out.append(f"{key} {show(current) if current is not None else 'unset'} "
                       f"(asked: {show(value)})")
    return out


def _daemon_handles():
    ray = _ray()
    handles = {}
    for node in ray.nodes():
        node_id = node["NodeID"]
        try:
            handles[node_id] = ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
        except ValueError:
            continue
    return handles


def status(address: str | None = None, *, runtime_dir: str | None = None, timeout: float = 30):
    """Every node's daemon: its address and stats (None for a daemon that does not answer)."""
    connect(address, resolve_runtime_dir(runtime_dir))
    ray = _ray()
    out = []
    for node_id, handle in _daemon_handles().items():
        try:
            stats = ray.get(handle.stats.remote(), timeout=timeout)
        except Exception as exc:  # a dead or stuck daemon is reported, not raised
            stats = {"error": f"{type(exc).__name__}: {exc}"}
        out.append({"node_id": node_id, "stats": stats})
    return out


def stop(address: str | None = None, *, runtime_dir: str | None = None, timeout: float = 30,
         notes: list | None = None) -> int:
    """Stop every daemon: the Ray-managed ones (and the local Ray cluster if cachemw
    started it), and this node's autostarted one, found by its lock (see launch.stop_local);
    clear what a dead one left and the node-DRAM checkpoint copies made through them.
    Returns the count of daemons stopped; ``notes`` gets a line per thing reclaimed."""
    runtime_dir = resolve_runtime_dir(runtime_dir)
    n = _stop_ray_daemons(address, runtime_dir, timeout)
    shared = held_by_another_host(runtime_dir)
    if shared is not None:  # its daemon and the checkpoint copies its trainers drain are
        log.warning("%s; nothing in it was stopped or removed", shared)  # another node's
        return n
    n += stop_local(runtime_dir, notes=notes)
    if remove_checkpoint_copies(runtime_dir) and notes is not None:
        notes.append(f"removed the node-DRAM checkpoint copies in {runtime_dir}/checkpoints "
                     f"(the durable ones are at each checkpointer's root)")
    return n


def _stop_ray_daemons(address: str | None, runtime_dir: str, timeout: float) -> int:
    address = own_address(address, runtime_dir)
    local = local_ray.read_state(runtime_dir) if address is None else None
    if address is None and local is None and not ray_address() and "ray" not in sys.modules:
        return 0  # no Ray cluster of ours, none given: nothing to stop through Ray
    try:
        state = connect(address, runtime_dir)
    except UnreachableCluster:  # the address given is wrong: nothing is stopped, said
        raise
    except Exception as exc:  # cluster unreachable: still clean up what cachemw started
        log.warning("could not reach the Ray cluster: %s", exc)
        state = None
    # the local cluster cachemw started, unreachable or dead (RAY_ADDRESS's was reached
    # instead): clear what is left of it
    if local is not None and local.get("started_by_cachemw") and (
            state is None or not local_ray.alive(local)):
        local_ray.stop(local["temp_dir"], local.get("strays"))
        local_ray.forget_state(runtime_dir)
    if state is None:
        return 0
    ray = _ray()
    handles = _daemon_handles()
    # stop all first (each stops placing daemons on new nodes), then kill them
    refs = {node_id: h.stop.remote() for node_id, h in handles.items()}
    stopped = 0  # cleanly: one that did not (hung, or its node gone) is killed, not counted
    for node_id, ref in refs.items():
        try:
            ray.get(ref, timeout=timeout)
            stopped += 1
        except Exception as exc:  # one daemon's failure never stops the stop
            log.warning("daemon on node %s did not stop cleanly (killed instead, if it still "
                        "runs): %s", node_id, exc)
    for handle in list(handles.values()) + list(_daemon_handles().values()):
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # gone already, or not killable: the stop goes on
            pass
    ray.shutdown()
    if address is None and state.get("started_by_cachemw"):
        local_ray.stop(state["temp_dir"], state.get("strays"))
        local_ray.forget_state(runtime_dir)
    deadline = time.monotonic() + 10
    while lookup(runtime_dir) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    return stopped
