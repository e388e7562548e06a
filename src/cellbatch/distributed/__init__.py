"""Data-parallel engine replicas on Ray: one endpoint, or one `generate`, over N engines.

Modules: `cluster` (joining a Ray cluster, or a local Ray instance started and stopped
with us), `replica` (the actor body: one Engine), `replicas` (`ReplicaSet`: starting
the actors, offline `generate` over them), `routing` (`PrefixRouter`: prefix affinity,
then the least loaded), `backend` (`ReplicaBackend`: the replicas behind
`cellbatch serve --replicas N`). Needs the `ray` extra (`pip install 'cellbatch[ray]'`);
nothing here imports Ray until replicas start.

    from cellbatch.distributed import ReplicaSet

    with ReplicaSet.start(replicas=2, threads_per_replica=1) as replicas:
        results = replicas.generate(prompts, max_new_tokens=64)
"""

from cellbatch.distributed.replicas import ReplicaSet

__all__ = ["ReplicaSet"]
