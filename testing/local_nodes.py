"""More Ray nodes on this machine, joined to the running local Ray: what `ray start --address=...` does on
another host, as ray.cluster_utils.Cluster starts its worker nodes (its own raylet, object store and workers).

    node = add_node({"tether-slot": 1})   # a node offering one replica slot
    drain_node(node)                      # what a cloud preemption / KubeRay scale-down asks of Ray
    kill_node(node)                       # the machine is gone: every process of the node, at once
    stop_node(node)                       # a teardown: stopped, and known to be gone

PRIVATE Ray API (ray._private.node.Node, RayParams; the same calls cluster_utils.Cluster.add_node makes,
Ray 2.60). Only for tests and benchmarks.
"""

import time

NODE_OBJECT_STORE_BYTES = 128 << 20


def add_node(resources: dict[str, float], num_cpus: int = 1, attempts: int = 2):
    """A worker node offering `resources` (and `num_cpus`), alive and still alive a moment later when this
    returns -> its Node handle. On a loaded 2-core host a fresh raylet has died within its first seconds
    (the GCS's health checks could not reach it; no error in its log): such a node is replaced, once."""
    for attempt in range(attempts):
        node = _start_node(resources, num_cpus)
        if _stays_alive(node):
            return node
        kill_node(node)
        print(f"local_nodes: node {node.node_id} died at start (attempt {attempt + 1} of {attempts})", flush=True)
    raise RuntimeError(f"no node with {resources} stayed alive in {attempts} attempts")


def _stays_alive(node, watch_s: float = 3.0) -> bool:
    """Whether every process of the node keeps running, and the GCS lists it alive, through `watch_s`."""
    import ray

    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        if node.dead_processes() or not any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
            return False
        time.sleep(0.5)
    return True


def _start_node(resources: dict[str, float], num_cpus: int):
    import ray
    from ray._private.node import Node
    from ray._private.parameter import RayParams
    from ray._private.services import wait_for_node

    head = ray._private.worker.global_worker.node
    params = RayParams(num_cpus=num_cpus, num_gpus=0, resources=dict(resources),
                       object_store_memory=NODE_OBJECT_STORE_BYTES, min_worker_port=0, max_worker_port=0,
                       node_ip_address=head.node_ip_address, gcs_address=head.gcs_address,
                       include_log_monitor=False, node_manager_port=0)
    params.dashboard_agent_listen_port = None  # a free port, not the head's agent's
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    wait_for_node(node.gcs_address, node.plasma_store_socket_name, 30)
    return node


def kill_node(node) -> None:
    """Every process of the node killed at once (no graceful exit): a machine that went away. The GCS finds out
    by its health checks (~15 s), scheduling onto the node meanwhile."""
    node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)


def stop_node(node, timeout_s: float = 60.0) -> None:
    """The node's processes stopped (gracefully where they will), and the GCS sure it is gone: nothing is
    scheduled onto it after this returns (what a test's teardown needs before the next test deploys)."""
    import ray

    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
    deadline = time.monotonic() + timeout_s
    while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the GCS still lists node {node.node_id} alive {timeout_s} s after it stopped")
        time.sleep(0.5)


def drain_node(node, deadline_s: float = 120.0) -> None:
    """Asks Ray to drain the node (reason: preemption, always accepted): Serve starts each replica there again
    on another node, then stops the old one gracefully."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._private.worker.global_worker.gcs_client
    deadline_ms = int((time.time() + deadline_s) * 1000)
    accepted, why = gcs.drain_node(node.node_id, autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION,
                                   "drained by a Tether test", deadline_ms)
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node.node_id}: {why}")
